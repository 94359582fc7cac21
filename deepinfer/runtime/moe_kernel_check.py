"""The MoE experts kernel (cpu_moe_kernel.py) against the torch path of `MoEExperts` /
`QuantizedMoEExperts`: the load-time self-test and the bound the tests use.

Bound. Both paths compute the same bf16 roundings of the same sums (gate and up, silu, the
product, the down projection, the routing weight, each add of the weighted sum), so against
the exact result in float64 each is off by at most its roundings, and kernel - torch by twice
that (the weighted sum is one float32 sum rounded once, as torch's bf16 index_add_ on CPU). Per output value, with g, u the exact gate / up values, y_s the exact expert outputs
and w_s the routing weights of token t's k experts:

    h error   <= 2^-7 |g| |u| (+ the float32 dot error, 2^-16 of the sum of |products|)
    y error   <= |W_down| @ (h error) + 2^-8 |y|
    out error <= sum_s |w_s| (y error_s) + 2^-7 sum_s |w_s| |y_s|

Quantized GGUF / int8 weights see int8 activations: one value of h a bf16 step apart may move
one int8 step of its block, max|h| / 127 times the largest weight of the row.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.quant.quantized_weight import FP8_BLOCK

_SHAPES = [  # (experts, hidden, intermediate, top-k): odd widths, tails, k up to 8
    (8, 64, 32, 2), (6, 67, 37, 3), (16, 136, 40, 8)]
_TOKENS = (1, 3, 8, 19)  # 19: experts with more tokens than one 8-row tile
# (format, hidden, intermediate): fp8 stacked (I a block multiple) and split; a GGUF and int8
_QUANT_SHAPES = [(FP8_BLOCK, 200, 128), (FP8_BLOCK, 130, 40), ("q8_0", 96, 64), ("q4_k", 256, 256),
                 ("int8", 72, 36)]


def rounding_bound(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: Tensor,
                   down: Tensor, int8_acts: bool = False) -> Tensor:
    """Allowed |kernel - torch| [T, H] (see the module docstring); weights float [E, ...]."""
    x64, gu, dn = x.double(), gate_up.double(), down.double()
    gu_abs, dn_abs = gu.abs(), dn.abs()
    dn_row_max = dn_abs.amax(dim=2)  # [E, H]
    inter = down.shape[2]
    bound = torch.zeros(x.shape, dtype=torch.float64)
    mags = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].double().tolist(), topk_ids[t].tolist()):
            dots = gu[e] @ x64[t]  # [2I]
            slack = 2.0 ** -16 * (gu_abs[e] @ x64[t].abs())
            g, u = dots[:inter], dots[inter:]
            h = torch.nn.functional.silu(g) * u
            h_err = 2.0 ** -7 * (g.abs() + slack[:inter]) * (u.abs() + slack[inter:])
            y = dn[e] @ h
            y_err = dn_abs[e] @ h_err + 2.0 ** -8 * y.abs() + 2.0 ** -16 * (dn_abs[e] @ h.abs())
            if int8_acts:
                y_err = y_err + dn_row_max[e] * h.abs().max() / 127 * 1.01
            bound[t] += abs(w) * y_err
            mags[t] += abs(w) * y.abs()
    return 2 * (bound + 2.0 ** -7 * mags) + 1e-6


def random_routing(num_tokens: int, num_experts: int, k: int, gen: torch.Generator):
    """Distinct experts per token (a top-k) and positive weights: (weights [T, k] f32, ids)."""
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=gen) + 0.1
    return weights, ids


def _check(got: Tensor | None, want: Tensor, bound: Tensor, case: str) -> str | None:
    if got is None:
        return f"{case}: the kernel did not take the input"
    err = (got.double() - want.double()).abs()
    bad = ~(err <= bound)  # NaN is bad
    if bad.any():
        return f"{case}: {int(bad.sum())} of {err.numel()} values off, max error {err.max().item():.3g}"
    return None


def _first_problem(case) -> str | None:
    """`case(num_tokens, num_threads)` over every token count, on one thread and on the
    caller's thread count (restored after); the first problem it reports, or None."""
    old_threads = torch.get_num_threads()
    try:
        for num_threads in sorted({1, old_threads}):
            torch.set_num_threads(num_threads)
            for num_tokens in _TOKENS:
                problem = case(num_tokens, num_threads)
                if problem is not None:
                    return problem
    finally:
        torch.set_num_threads(old_threads)
    return None


def bf16_mismatch(kernel) -> str | None:
    """First disagreement of the kernel with MoEExperts' torch path (bf16), or None."""
    from deepinfer.moe.layer import MoEExperts

    gen = torch.Generator().manual_seed(0)
    for num_experts, hidden, inter, k in _SHAPES:
        experts = MoEExperts(num_experts, hidden, inter, torch.bfloat16).to("cpu")
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / hidden ** 0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / inter ** 0.5)

        def case(num_tokens: int, num_threads: int) -> str | None:
            x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
            weights, ids = random_routing(num_tokens, num_experts, k, gen)
            want = experts.torch_forward(x, weights, ids)
            got = kernel.bf16(x, weights, ids, experts.gate_up_proj, experts.down_proj)
            bound = rounding_bound(x, weights, ids, experts.gate_up_proj.float(),
                                   experts.down_proj.float())
            return _check(got, want, bound, f"bf16 E={num_experts} H={hidden} I={inter} "
                          f"k={k} T={num_tokens} threads={num_threads}")

        problem = _first_problem(case)
        if problem is not None:
            return problem
    return None


def random_quantized_experts(fmt: str, num_experts: int, hidden: int, inter: int,
                             gen: torch.Generator, quant_kernel):
    """QuantizedMoEExperts of random `fmt` weights on `quant_kernel` (gate and up stacked
    where they stack, as the FP8 loader builds them)."""
    from deepinfer.quant.fused_quantized import QuantizedMoEExperts, fused_quantized_linear
    from deepinfer.quant.quantized_linear import QuantizedLinear
    from deepinfer.runtime.cpu_quant_linear import random_blocks

    gate_up, down = [], []
    for _ in range(num_experts):
        gate_up.append(fused_quantized_linear([random_blocks(fmt, inter, hidden, gen),
                                               random_blocks(fmt, inter, hidden, gen)]))
        down.append(QuantizedLinear(random_blocks(fmt, hidden, inter, gen)))
    for layer in (*gate_up, *down):
        layer.kernel = quant_kernel
    return QuantizedMoEExperts(gate_up, down, inter)


def quant_mismatch(kernel, quant_kernel, attach_quantized) -> str | None:
    """First disagreement with QuantizedMoEExperts' torch path on `quant_kernel`, or None.
    `attach_quantized(experts, kernel)` is the loader's own (passed in: that module imports
    this one)."""
    gen = torch.Generator().manual_seed(1)
    for fmt, hidden, inter in _QUANT_SHAPES:
        experts = random_quantized_experts(fmt, 6, hidden, inter, gen, quant_kernel)
        if attach_quantized(experts, kernel) == 0:
            return f"{fmt}: the kernel did not take the experts"
        gate_up = torch.stack([torch.cat([p.dequantize() for p in m.parts]) for m in experts.gate_up])
        down = torch.stack([m.qweight.dequantize() for m in experts.down])

        def case(num_tokens: int, num_threads: int) -> str | None:
            x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
            weights, ids = random_routing(num_tokens, 6, 3, gen)
            want = experts.torch_forward(x, weights, ids)
            got = kernel.quantized(x, weights, ids, experts.kernel_descs, inter)
            bound = rounding_bound(x, weights, ids, gate_up, down, int8_acts=fmt != FP8_BLOCK)
            return _check(got, want, bound, f"{fmt} H={hidden} I={inter} T={num_tokens} "
                          f"threads={num_threads}")

        problem = _first_problem(case)
        if problem is not None:
            return problem
    return None
