"""Routed MoE experts for decode-sized batches on CPU in one C call (kernels/moe_experts.c).

At decode and verify (1..`max_tokens` tokens x top-k) the torch path of `MoEExperts` runs one
gate_up and one down F.linear per active expert plus sort / gather / index_add ops: per-op
overhead, not the weight stream, sets its speed. The kernel groups the (token, expert) pairs,
streams each active expert's weights once for all its tokens (in tiles of 8 tokens that reuse
the weight row from cache) and sums the weighted outputs, reproducing every bf16
rounding of the torch path (the two differ only where a float32 dot summed in another order
rounds to another bf16 value).

`install_moe_kernels(model)` gives every CPU `MoEExperts` (bf16) and `QuantizedMoEExperts`
(whose projections already run on the verified quantized-linear kernel) the kernel once it
passed its load-time self-test against the torch path; a disagreement logs one warning and
the layers keep the torch path. Inputs of more than `max_tokens` rows (prefill) always take
the torch path. DEEPINFER_MOE_KERNEL=0 keeps the torch path everywhere.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from contextlib import nullcontext

import torch
from torch import Tensor
from torch.autograd import profiler as _profiler

from deepinfer.runtime.cpu_kernel_build import load_kernel_library, self_test

logger = logging.getLogger(__name__)
_P, _INT = ctypes.c_void_p, ctypes.c_int
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512-bf16"}


def enabled() -> bool:
    return os.environ.get("DEEPINFER_MOE_KERNEL", "1") != "0"


def _named(name: str):
    """A profiler range while the profiler records (it cannot see the C call), else nothing."""
    return torch.profiler.record_function(name) if _profiler._is_profiler_enabled else nullcontext()


class MoEExpertsKernel:
    """The `kernel` of `MoEExperts` / `QuantizedMoEExperts`: `bf16(...)` / `quantized(...)`
    return the routed experts' weighted sum [T, hidden], or None when they do not take the
    input (the caller then runs its torch path)."""

    def __init__(self, lib: ctypes.CDLL, quant_isa: int) -> None:
        self._bf16 = lib.moe_experts_bf16
        self._bf16.argtypes = [_P, _P, _P, _P, _P, _P, _INT, _INT, _INT, _INT, _INT, _INT]
        self._bf16.restype = _INT
        self._quant = lib.moe_experts_quant
        self._quant.argtypes = [_P, _INT, _P, _P, _P, _P, _INT, _INT, _INT, _INT, _INT, _INT]
        self._quant.restype = _INT
        lib.moe_experts_isa.restype = _INT
        lib.moe_experts_max_tokens.restype = _INT
        self.isa_name = ISA_NAMES[lib.moe_experts_isa()]
        self.max_tokens = lib.moe_experts_max_tokens()
        self.quant_isa = quant_isa
        self.takes_bf16 = self.takes_quantized = False  # set by the self-tests

    def _routing(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor] | None:
        num_tokens, k = topk_ids.shape
        if not (1 <= num_tokens <= self.max_tokens and x.dim() == 2 and x.shape[0] == num_tokens
                and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous()
                and num_tokens * k <= self.max_tokens * 32 and topk_weights.shape == topk_ids.shape):
            return None
        return (topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int64).contiguous())

    def bf16(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: Tensor,
             down: Tensor) -> Tensor | None:
        """x [T, H] bf16, gate_up [E, 2I, H], down [E, H, I] bf16 -> [T, H], or None."""
        routing = self._routing(x, topk_weights, topk_ids)
        if (routing is None or gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16
                or gate_up.device.type != "cpu" or not gate_up.is_contiguous()
                or not down.is_contiguous() or gate_up.dim() != 3 or down.dim() != 3):
            return None
        num_experts, two_inter, hidden = gate_up.shape
        inter = two_inter // 2
        if hidden != x.shape[1] or tuple(down.shape) != (num_experts, hidden, inter):
            return None
        weights, ids = routing
        out = torch.empty_like(x)
        with _named("deepinfer::moe_experts[bf16]"):
            rc = self._bf16(x.data_ptr(), gate_up.data_ptr(), down.data_ptr(), ids.data_ptr(),
                            weights.data_ptr(), out.data_ptr(), ids.shape[0], ids.shape[1],
                            num_experts, hidden, inter, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"MoE experts kernel failed (code {rc})")
        return out

    def quantized(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, descs: Tensor,
                  intermediate_size: int) -> Tensor | None:
        """x [T, H] bf16, descs [E, 3, 8] (`expert_descriptors`) -> [T, H], or None."""
        routing = self._routing(x, topk_weights, topk_ids)
        if routing is None:
            return None
        weights, ids = routing
        out = torch.empty_like(x)
        with _named("deepinfer::moe_experts[quantized]"):
            rc = self._quant(descs.data_ptr(), self.quant_isa, x.data_ptr(), ids.data_ptr(),
                             weights.data_ptr(), out.data_ptr(), ids.shape[0], ids.shape[1],
                             descs.shape[0], x.shape[1], intermediate_size,
                             torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"quantized MoE experts kernel failed (code {rc})")
        return out


def expert_descriptors(experts) -> Tensor | None:
    """[E, 3, 8] int64: each expert's gate_up (or gate, up) and down weight descriptors
    (kernels/quant_formats.h), or None when some projection is not one the kernel takes (a
    bias, more than two gate/up parts, mixed formats, a weight the quantized kernel refuses)."""
    from deepinfer.quant.quantized_linear import QuantizedLinear
    from deepinfer.runtime.cpu_quant_linear import kernel_takes, weight_descriptor

    rows = []
    for gate_up, down in zip(experts.gate_up, experts.down):
        if not (isinstance(gate_up, QuantizedLinear) and isinstance(down, QuantizedLinear)):
            return None
        parts = [*gate_up.parts, *down.parts]
        if (gate_up.bias is not None or down.bias is not None or len(gate_up.parts) > 2
                or len(down.parts) != 1 or not all(kernel_takes(p) for p in parts)):
            return None
        gate_desc = [weight_descriptor(p) for p in gate_up.parts]
        if len(gate_desc) == 1:
            gate_desc.append(torch.zeros(8, dtype=torch.int64))
        rows.append(torch.stack([*gate_desc, weight_descriptor(down.parts[0])]))
    descs = torch.stack(rows)  # [E, 3, 8]
    gate_formats = {int(f) for f in descs[:, 0, 0]}
    if len(gate_formats) != 1 or len({int(f) for f in descs[:, 2, 0]}) != 1:
        return None  # one activation format per phase (see kernels/moe_experts.c)
    return descs


def attach_quantized(experts, kernel: MoEExpertsKernel) -> int:
    """Give a QuantizedMoEExperts `kernel` when it takes its weights: 1 if so, else 0."""
    descs = expert_descriptors(experts)
    if descs is None:
        return 0
    experts.set_kernel(kernel, descs)
    return 1


@functools.lru_cache(maxsize=4)
def _load(quant_isa: int | None) -> MoEExpertsKernel | None:
    """The kernel with `takes_bf16` / `takes_quantized` set by their self-tests (quantized
    experts only with the verified quantized-linear kernel, `quant_isa` not None)."""
    from deepinfer.runtime import moe_kernel_check as check

    lib = load_kernel_library("moe_experts")
    if lib is None:
        return None
    kernel = MoEExpertsKernel(lib, 0 if quant_isa is None else quant_isa)
    with torch.inference_mode():
        kernel.takes_bf16 = self_test(lib, f"moe_experts[{kernel.isa_name}]",
                                      lambda: check.bf16_mismatch(kernel))
        if quant_isa is not None:
            from deepinfer.runtime.cpu_quant_linear import load_quant_linear
            quant = load_quant_linear()
            kernel.takes_quantized = self_test(lib, f"moe_experts_quant[{quant.isa_name}]",
                                               lambda: check.quant_mismatch(kernel, quant,
                                                                            attach_quantized))
    return kernel if kernel.takes_bf16 or kernel.takes_quantized else None


def load_moe_kernel(quantized: bool = True) -> MoEExpertsKernel | None:
    """The verified kernel, or None (disabled, no compiler, or it disagrees with torch).
    `quantized`: also verify it on quantized experts (loads the quantized-linear kernel)."""
    if not enabled():
        return None
    if not quantized:
        return _load(None)
    from deepinfer.runtime.cpu_quant_linear import load_quant_linear

    quant = load_quant_linear()
    return _load(None if quant is None else quant.isa)


def install_moe_kernels(model: torch.nn.Module) -> int:
    """Give every CPU routed-experts module of `model` the verified kernel; returns how many
    (0 when there are none or the kernel is unavailable: the torch path stays)."""
    from deepinfer.moe.layer import MoEExperts
    from deepinfer.quant.fused_quantized import QuantizedMoEExperts

    dense = [m for m in model.modules() if type(m) is MoEExperts
             and m.gate_up_proj.device.type == "cpu" and m.gate_up_proj.dtype == torch.bfloat16]
    quantized = [m for m in model.modules() if isinstance(m, QuantizedMoEExperts)
                 and all(getattr(p, "kernel", None) is not None for p in [*m.gate_up, *m.down])]
    if not dense and not quantized:
        return 0
    kernel = load_moe_kernel(quantized=bool(quantized))
    if kernel is None:
        return 0
    count = 0
    if kernel.takes_bf16:
        for module in dense:
            module.kernel = kernel
        count += len(dense)
    if kernel.takes_quantized:
        count += sum(attach_quantized(module, kernel) for module in quantized)
    logger.info("MoE experts kernel (%s) in %d layers", kernel.isa_name, count)
    return count
