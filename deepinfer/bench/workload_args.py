"""The workload flags shared by `deepinfer bench serve`, `simulate` and `plan` (same names, same
defaults), the `WorkloadConfig` they describe, and the report flags of `bench serve` and
`simulate`."""
from __future__ import annotations

import argparse
import os

from deepinfer.bench.trace_formats import FORMATS, TIME_UNITS
from deepinfer.bench.traces import ShrinkConfig
from deepinfer.bench.workloads import WorkloadConfig


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="random",
                   help="random | shared-prefix | images | trace:PATH (Mooncake / Bailian JSONL, "
                        "Azure / BurstGPT CSV, generic JSONL/CSV; gzip too)")
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--range-ratio", type=float, default=0.0)
    w.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--shared-prefix-len", type=int, default=512)
    w.add_argument("--request-rate", type=float, default=None,
                   help="Poisson req/s (inf: all at once); default: trace timestamps, else inf")
    w.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times")
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply trace lengths")
    w.add_argument("--max-input-len", type=int, default=None)
    w.add_argument("--max-output-len", type=int, default=None)
    w.add_argument("--trace-format", default="auto", choices=("auto",) + FORMATS,
                   help="trace layout; auto: detected from the file's keys/columns")
    w.add_argument("--trace-time-unit", default=None, choices=tuple(TIME_UNITS),
                   help="unit of numeric trace timestamps (default: the format's: Mooncake ms, "
                        "Bailian / BurstGPT / generic s)")
    w.add_argument("--trace-block-tokens", type=int, default=None, metavar="N",
                   help="tokens per trace hash_ids entry (default: the format's: Mooncake 512, "
                        "Bailian 16, generic inferred from the rows)")
    w.add_argument("--trace-start", type=int, default=0, metavar="N",
                   help="replay the trace from its N-th request (skip the first N; a later "
                        "window of the same trace)")
    w.add_argument("--token-id-range", default="1000,30000", help="LOW,HIGH of random ids")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--images-per-request", type=int, default=1, help="images workload")
    w.add_argument("--image-sizes", default="336x336", metavar="WxH[,WxH...]",
                   help="images workload: sizes drawn uniformly per image")
    w.add_argument("--num-unique-images", type=int, default=0,
                   help="images workload: draw images from a pool of N (repeats); 0: all new")


def add_report_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The report flags of `bench serve` and `simulate` (SLOs for goodput, JSON, plot); the
    group is returned for a command's own report flags."""
    o = p.add_argument_group("report")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--json", dest="json_path", default=None)
    o.add_argument("--plot", dest="plot_path", default=None)
    return o


def workload_config_from_args(args) -> WorkloadConfig:
    """Raises ValueError for a bad --token-id-range or a missing trace file."""
    try:
        low, high = (int(x) for x in args.token_id_range.split(","))
    except ValueError:
        raise ValueError("--token-id-range must be LOW,HIGH") from None
    if args.workload.startswith("trace:") and not os.path.exists(args.workload[6:]):
        raise ValueError(f"trace file not found: {args.workload[6:]}")
    return WorkloadConfig(
        kind=args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, num_groups=args.num_groups,
        shared_prefix_len=args.shared_prefix_len, request_rate=args.request_rate,
        time_scale=args.time_scale,
        shrink=ShrinkConfig(args.length_scale, args.max_input_len, args.max_output_len),
        token_id_range=(low, high), seed=args.seed,
        trace_format=getattr(args, "trace_format", "auto"),
        trace_time_unit=getattr(args, "trace_time_unit", None),
        trace_block_tokens=getattr(args, "trace_block_tokens", None),
        trace_start=getattr(args, "trace_start", 0),
        **image_workload_fields(args))


def image_workload_fields(args) -> dict:
    """The images workload's fields (absent flags, e.g. in `simulate`: defaults)."""
    sizes_text = getattr(args, "image_sizes", "336x336")
    try:
        sizes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in sizes_text.split(","))
        if any(len(s) != 2 for s in sizes):
            raise ValueError
    except ValueError:
        raise ValueError(f"--image-sizes must be WxH[,WxH...], got {sizes_text!r}") from None
    return {"images_per_request": getattr(args, "images_per_request", 1), "image_sizes": sizes,
            "num_unique_images": getattr(args, "num_unique_images", 0)}
