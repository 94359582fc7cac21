"""Topic groups of the command-line flags, so `deepinfer serve --help` reads by topic.

Flags are defined next to the code that uses them (engine, cluster, media, …); each module asks
for its topic's group here instead of making its own, so one topic shows once however many
modules add to it. A leaf module (argparse only): the flag definitions below cli/ import it
without importing the CLI.
"""
from __future__ import annotations

import argparse

# key -> title, in the order `--help` shows them (a group shows only once it has a flag).
TOPICS: dict[str, str] = {
    "model": "model and weights",
    "kv-cache": "KV cache",
    "scheduling": "scheduling and batching",
    "speculative": "speculative decoding",
    "outputs": "outputs and sampling",
    "structured": "structured outputs",
    "tools": "tools, chat templates and reasoning",
    "server": "HTTP server",
    "security": "security and request limits",
    "multimodal": "image inputs (vision-language models)",
    "disaggregation": "disaggregated serving (both worker counts, or neither)",
    "prefix-store": "shared prefix store",
    "parallel": "data and expert parallelism",
    "cluster": "cluster placement (local processes or Ray)",
    "health": "health checks and restarts",
}

_ATTR = "_deepinfer_topic_groups"


def create_groups(parser: argparse.ArgumentParser) -> None:
    """Make every topic's group now, in TOPICS order (help lists groups in creation order)."""
    for topic in TOPICS:
        group(parser, topic)


def group(parser: argparse.ArgumentParser, topic: str):
    """The argument group of `topic` on `parser` (made on first use)."""
    if topic not in TOPICS:
        raise KeyError(f"unknown flag topic {topic!r}; add it to arg_groups.TOPICS")
    groups = parser.__dict__.setdefault(_ATTR, {})
    if topic not in groups:
        groups[topic] = parser.add_argument_group(TOPICS[topic])
    return groups[topic]

