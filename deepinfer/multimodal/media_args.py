"""`deepinfer serve` flags for image inputs, turned into a `MediaPolicy`.

`--limit-mm-per-prompt` takes vLLM's JSON shape ('{"image": 2}') or `image=2`; bad values raise
ValueError with a one-line message (the CLI's exit 2).
"""
from __future__ import annotations

import argparse
import json

from deepinfer.arg_groups import group
from deepinfer.multimodal.image_input import MediaPolicy

DEFAULT_LIMIT_PER_PROMPT = MediaPolicy().limit_per_prompt
SUPPORTED_MODALITIES = ("image",)


def add_media_args(parser: argparse.ArgumentParser) -> None:
    g = group(parser, "multimodal")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="LIMITS",
                   help=f"most images in one prompt: '{{\"image\": 2}}' or image=2 "
                        f"(default {DEFAULT_LIMIT_PER_PROMPT})")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="allow file:// image URLs under this directory (default: refused)")
    g.add_argument("--allowed-media-domains", default=None, nargs="+", metavar="HOST",
                   help="allow http(s) image URLs from these hosts (default: the server never "
                        "fetches from the network)")
    g.add_argument("--max-image-pixels", type=int, default=MediaPolicy().max_pixels,
                   help="refuse images with more pixels than this (width x height)")
    g.add_argument("--allow-private-media", action="store_true",
                   help="let allowed media hosts resolve to private and loopback addresses "
                        "(default: public addresses only; link-local is always refused)")
    g.add_argument("--media-fetch-timeout", type=float, metavar="SECONDS",
                   default=MediaPolicy().media_fetch_timeout_s,
                   help="deadline for one whole image fetch, redirects included")
    g.add_argument("--max-media-redirects", type=int, default=MediaPolicy().max_media_redirects,
                   help="redirects followed per image fetch, each hop checked again "
                        "(0: refuse redirects)")


def parse_limit_mm_per_prompt(text: str | None) -> int:
    """The image limit from '{"image": N}' or 'image=N' (other modalities are refused)."""
    if text is None:
        return DEFAULT_LIMIT_PER_PROMPT
    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            limits = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--limit-mm-per-prompt is not valid JSON: {e.msg}") from None
        if not isinstance(limits, dict):
            raise ValueError("--limit-mm-per-prompt JSON must be an object like {\"image\": 2}")
    else:
        limits = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--limit-mm-per-prompt expects image=N or '{{\"image\": N}}', got {text!r}")
            limits[key.strip()] = value.strip()
    unknown = sorted(set(limits) - set(SUPPORTED_MODALITIES))
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: unsupported modality {', '.join(unknown)} "
                         f"(supported: {', '.join(SUPPORTED_MODALITIES)})")
    value = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
    try:
        count = int(value)
        if isinstance(value, float) or isinstance(value, bool) or str(count) != str(value).strip():
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"--limit-mm-per-prompt image limit must be a whole number, got {value!r}") from None
    if count < 0:
        raise ValueError(f"--limit-mm-per-prompt image limit must be >= 0, got {count}")
    return count


def media_policy_from_args(args: argparse.Namespace) -> MediaPolicy:
    domains = tuple(d.strip().lower() for arg in (getattr(args, "allowed_media_domains", None) or ())
                    for d in arg.split(",") if d.strip())
    for domain in domains:
        if "/" in domain or ":" in domain:
            raise ValueError(f"--allowed-media-domains takes host names, got {domain!r}")
    local = getattr(args, "allowed_local_media_path", None)
    if local is not None:
        import os
        if not os.path.isdir(local):
            raise ValueError(f"--allowed-local-media-path {local} is not a directory")
    max_pixels = getattr(args, "max_image_pixels", MediaPolicy().max_pixels)
    if max_pixels < 1:
        raise ValueError(f"--max-image-pixels must be >= 1, got {max_pixels}")
    defaults = MediaPolicy()
    timeout = getattr(args, "media_fetch_timeout", defaults.media_fetch_timeout_s)
    if not timeout > 0:
        raise ValueError(f"--media-fetch-timeout must be > 0, got {timeout}")
    redirects = getattr(args, "max_media_redirects", defaults.max_media_redirects)
    if redirects < 0:
        raise ValueError(f"--max-media-redirects must be >= 0, got {redirects}")
    return MediaPolicy(limit_per_prompt=parse_limit_mm_per_prompt(getattr(args, "limit_mm_per_prompt", None)),
                       max_pixels=max_pixels, allowed_local_media_path=local,
                       allowed_media_domains=domains,
                       allow_private_media=getattr(args, "allow_private_media", False),
                       media_fetch_timeout_s=timeout, max_media_redirects=redirects)
