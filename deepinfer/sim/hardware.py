"""Accelerator datasheets for the analytic (roofline) step-time model. Pure.

Numbers are the vendors' published peaks for dense math (no 2:4 sparsity) of one GPU in its
usual server form (SXM / NVL72). `nvlink_bytes_per_s` is one direction of one GPU's scale-up
links; `network_bytes_per_s` is its scale-out NIC (one direction). Peaks are never reached:
the step-time model applies utilisation factors on top (see `roofline.RooflineConfig`).
"""
from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
GB = 1e9


@dataclass(frozen=True)
class AcceleratorSpec:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float  # dense FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, one direction
    network_bytes_per_s: float  # scale-out NIC per GPU, one direction
    gpus_per_node: int = 8  # the scale-up (NVLink) domain
    fp4_flops: float | None = None  # dense FP/NVFP4 FLOP/s (Blackwell); None: no FP4 units

    def __post_init__(self) -> None:
        for name in ("bf16_flops", "fp8_flops", "hbm_bytes", "hbm_bytes_per_s",
                     "nvlink_bytes_per_s", "network_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AcceleratorSpec.{name} must be positive")
        if self.gpus_per_node < 1:
            raise ValueError("gpus_per_node must be >= 1")
        if self.fp4_flops is not None and not self.fp4_flops > 0:
            raise ValueError("AcceleratorSpec.fp4_flops must be positive (or None)")

    def flops(self, dtype: str) -> float:
        if dtype == "fp8":
            return self.fp8_flops
        if dtype in ("bf16", "fp16"):
            return self.bf16_flops
        if dtype == "fp4":
            if self.fp4_flops is None:
                raise ValueError(f"{self.name} has no FP4 tensor cores")
            return self.fp4_flops
        raise ValueError(f"unknown compute dtype {dtype!r}: use fp4, fp8 or bf16")


ACCELERATORS: dict[str, AcceleratorSpec] = {a.name: a for a in (
    # H800 SXM: H100 compute and HBM, NVLink cut to 400 GB/s bidirectional; 8x 400 Gb/s IB.
    AcceleratorSpec("H800", 989 * TERA, 1979 * TERA, 80 * GB, 3.35 * TERA, 200 * GB, 50 * GB),
    AcceleratorSpec("H100", 989 * TERA, 1979 * TERA, 80 * GB, 3.35 * TERA, 450 * GB, 50 * GB),
    AcceleratorSpec("H200", 989 * TERA, 1979 * TERA, 141 * GB, 4.8 * TERA, 450 * GB, 50 * GB),
    AcceleratorSpec("B200", 2250 * TERA, 4500 * TERA, 180 * GB, 8.0 * TERA, 900 * GB, 100 * GB,
                    fp4_flops=9000 * TERA),
    # GB200 NVL72: one Blackwell GPU of the 72-GPU NVLink domain (NVL72 datasheet / 72:
    # 13.4 TB HBM3e, 1,440 PF sparse FP4 = 10 PF dense per GPU).
    AcceleratorSpec("GB200", 2500 * TERA, 5000 * TERA, 186 * GB, 8.0 * TERA, 900 * GB, 100 * GB,
                    gpus_per_node=72, fp4_flops=10000 * TERA),
)}


def accelerator(name: str) -> AcceleratorSpec:
    spec = ACCELERATORS.get(name.upper())
    if spec is None:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {sorted(ACCELERATORS)}")
    return spec
