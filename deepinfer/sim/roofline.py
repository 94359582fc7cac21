"""Analytic step time of one worker (a group of accelerators) from a roofline. Pure.

A worker is `num_accelerators` GPUs running attention data-parallel (each GPU holds the dense
weights and a 1/G share of the requests) and the routed experts expert-parallel over an EP
group of `ep_size` GPUs (the worker and its peers in the group are assumed equally loaded, as
the routers and EPLB aim for). Per GPU and step:

    linear phase     max(2 · active_params · tokens / (flops · mfu),
                         (dense weights + touched local experts) / (hbm_bw · bw_eff))
    attention phase  max(attn_flops_per_pair · pairs / (flops · attn_mfu),
                         kv_bytes · Σ(P + x) / (hbm_bw · bw_eff))
    EP all-to-all    tokens · top_k · hidden · (dispatch + combine bytes) per MoE layer,
                     the share leaving the node over the NIC, the rest (but the pairs whose
                     expert is local) over NVLink, plus `a2a_latency_s` per dispatch and per
                     combine; `ep_collective: all-gather`: (EP - 1) copies per token instead
    step             compute + all-to-all − overlap · min(compute, all-to-all), plus
                     `step_overhead_s`: `overlap` is the share of the shorter one that the
                     two-micro-batch pipeline hides (1: max of the two, 0: their sum)

Routed experts may use another precision than the rest (`expert_dtype`: NVFP4 experts on
Blackwell read 0.5 B per parameter and run at the FP4 peak); the dispatch may too
(`dispatch_bytes_per_value`).

Prefill chunks (x > 1) use the expanded-MLA attention FLOPs, decodes the absorbed form.

With `expert_load` set (sim.expert_load), each worker (`for_worker`) draws its steps' expert
loads and runs the engine's EPLB planner on them; the routed-expert GEMM FLOPs and the
all-to-all bytes of a step scale by its imbalance (max / mean rank load, mean over layers): an
EP step is as slow as its busiest rank. A rebalance adds its weight moves to the step once.
Without it every rank carries the mean load (factor 1, the formula above unchanged).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim.analytic_model import AnalyticModel
from deepinfer.sim.expert_load import EPShape, ExpertLoadSpec, ExpertLoadTracker
from deepinfer.sim.hardware import AcceleratorSpec


@dataclass(frozen=True)
class RooflineConfig:
    """Deployment and efficiency assumptions (all stated in reports)."""

    num_accelerators: int = 8  # GPUs of one worker
    ep_size: int | None = None  # GPUs in the expert-parallel group (None: the worker's)
    mfu: float = 0.6  # achieved / peak FLOP/s of the GEMMs
    attn_mfu: float = 0.4  # achieved / peak FLOP/s of attention kernels
    bw_eff: float = 0.8  # achieved / peak HBM bandwidth
    net_eff: float = 0.8  # achieved / peak link bandwidth
    a2a_latency_s: float = 20e-6  # fixed cost of one dispatch or combine
    overlap_comm: bool = True  # two micro-batches hide all-to-all behind compute
    overlap: float | None = None  # share of min(compute, all-to-all) hidden (None: 1 with
    # overlap_comm, else 0)
    step_overhead_s: float = 1e-3  # launch, scheduling, sampling
    num_redundant_experts: int = 0  # EPLB replicas over the EP group (per layer)
    node_dedup: bool = False  # a token crosses the NIC once per node (DeepEP normal kernels,
    # prefill) instead of once per remote expert (low-latency kernels, decode)
    expert_load: ExpertLoadSpec | None = None  # None: every EP rank carries the mean load
    expert_dtype: str | None = None  # routed experts' weights and GEMMs (None: the model's)
    dispatch_bytes_per_value: float | None = None  # None: the model's (fp8: 1)
    # all-to-all: dispatch/combine of each (token, expert) pair (DeepEP); all-gather: every
    # token to every EP rank and a reduce-scatter back (NCCL collectives, vLLM's DP + EP)
    ep_collective: str = "all-to-all"
    # MTP: each decode row also verifies this many draft tokens (more GEMM rows and attention
    # queries over the same KV read); the step emits 1 + accepted tokens per row, which the
    # caller counts (the scheduler still advances one token per step)
    mtp_draft_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_load", ExpertLoadSpec.from_value(self.expert_load))
        if self.num_accelerators < 1 or (self.ep_size is not None and self.ep_size < 1):
            raise ValueError("num_accelerators and ep_size must be >= 1")
        for name in ("mfu", "attn_mfu", "bw_eff", "net_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.a2a_latency_s < 0 or self.step_overhead_s < 0 or self.num_redundant_experts < 0:
            raise ValueError("latencies, overheads and redundant experts must be >= 0")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ValueError("overlap must be in [0, 1]")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            raise ValueError(f"expert_dtype must be fp4, fp8 or bf16, got {self.expert_dtype!r}")
        if self.dispatch_bytes_per_value is not None and not self.dispatch_bytes_per_value > 0:
            raise ValueError("dispatch_bytes_per_value must be positive")
        if self.mtp_draft_tokens < 0:
            raise ValueError("mtp_draft_tokens must be >= 0")
        if self.ep_collective not in ("all-to-all", "all-gather"):
            raise ValueError(f"ep_collective must be all-to-all or all-gather, got "
                             f"{self.ep_collective!r}")

    @property
    def overlap_share(self) -> float:
        if self.overlap is not None:
            return self.overlap
        return 1.0 if self.overlap_comm else 0.0


EXPERT_BYTES_PER_PARAM = {"fp4": 0.5, "fp8": 1.0, "bf16": 2.0}


def expert_bytes_per_layer(model: AnalyticModel, config: RooflineConfig) -> float:
    """One routed expert of one layer in the deployment's expert precision."""
    if config.expert_dtype is None:
        return model.expert_bytes_per_layer
    return model.expert_params * EXPERT_BYTES_PER_PARAM[config.expert_dtype]


class RooflineStepTime:
    """`step_time_s(chunks)` for one worker; see the module docstring for the formula."""

    def __init__(self, model: AnalyticModel, accel: AcceleratorSpec,
                 config: RooflineConfig | None = None,
                 expert_load: ExpertLoadTracker | None = None) -> None:
        self.model = model
        self.accel = accel
        self.config = config or RooflineConfig()
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.publish_s_per_byte = 0.0  # store writes overlap on accelerators (DMA, not cores)
        self.expert_load = expert_load  # this worker's loads and placement (None: balanced)

    def for_worker(self, index: int) -> "RooflineStepTime":
        """The step model of one worker of a pool: with `expert_load`, its own loads, window
        and placement (the pool's model stays balanced: the cost model fitted to it for
        budgets and routing, as the engine's cost model, knows nothing of expert placement)."""
        spec = self.config.expert_load
        if spec is None or not self.model.is_moe:
            return self
        return RooflineStepTime(self.model, self.accel, self.config,
                                ExpertLoadTracker(spec, self.ep_shape(), index))

    def ep_shape(self) -> EPShape:
        m, a, c = self.model, self.accel, self.config
        return EPShape(num_layers=m.num_moe_layers, num_experts=m.num_experts,
                       top_k=m.num_experts_per_tok,
                       num_physical=m.num_experts + c.num_redundant_experts,
                       num_ranks=self.ep_size, ranks_per_node=a.gpus_per_node,
                       expert_bytes=expert_bytes_per_layer(m, c),
                       nvlink_bytes_per_s=a.nvlink_bytes_per_s * c.net_eff,
                       network_bytes_per_s=a.network_bytes_per_s * c.net_eff)

    def expert_load_stats(self) -> dict[str, float] | None:
        return None if self.expert_load is None else self.expert_load.stats()

    @property
    def ep_size(self) -> int:
        return self.config.ep_size or self.config.num_accelerators

    def breakdown(self, chunks: Sequence[ChunkShape], imbalance: float = 1.0) -> dict[str, float]:
        """Seconds of each term of one step (per GPU of the busiest rank when `imbalance`,
        its max / mean routed load, is above 1)."""
        m, a, c = self.model, self.accel, self.config
        g = c.num_accelerators
        rows = 1 + c.mtp_draft_tokens  # query tokens per decode row
        tokens = sum(ch.num_new_tokens if ch.num_new_tokens > 1 else rows
                     for ch in chunks) / g
        prefill_pairs = sum(ch.num_new_tokens * (ch.context_len + ch.num_new_tokens / 2)
                            for ch in chunks if ch.num_new_tokens > 1) / g
        decode_pairs = rows * sum(ch.context_len + 1 for ch in chunks
                                  if ch.num_new_tokens == 1) / g
        kv_tokens = sum(ch.context_len + ch.num_new_tokens for ch in chunks) / g
        flops = a.flops(m.compute_dtype)
        routed = m.num_moe_layers * m.num_experts_per_tok * m.expert_params
        expert_dtype = c.expert_dtype or m.compute_dtype
        if expert_dtype == m.compute_dtype:
            linear_compute = 2.0 * m.active_params * tokens / (flops * c.mfu)
            # The busiest rank's extra routed-expert GEMMs (+ 0.0 when balanced: bit-equal).
            linear_compute += (imbalance - 1.0) * 2.0 * routed * tokens / (flops * c.mfu)
        else:
            expert_flops = a.flops(expert_dtype)
            linear_compute = (2.0 * (m.active_params - routed) * tokens / (flops * c.mfu)
                              + imbalance * 2.0 * routed * tokens / (expert_flops * c.mfu))
        weights = m.dense_weight_bytes + self._local_expert_bytes(tokens)
        linear_memory = weights / (a.hbm_bytes_per_s * c.bw_eff)
        attn_flops = (m.prefill_attn_flops_per_pair * prefill_pairs
                      + m.decode_attn_flops_per_pair * decode_pairs)
        attn_compute = attn_flops / (a.bf16_flops * c.attn_mfu)
        attn_memory = m.kv_bytes_per_token * kv_tokens / (a.hbm_bytes_per_s * c.bw_eff)
        return {"linear": max(linear_compute, linear_memory),
                "attention": max(attn_compute, attn_memory),
                "all_to_all": self._all_to_all_s(tokens, imbalance),
                "overhead": c.step_overhead_s}

    def step_time_s(self, chunks: Sequence[ChunkShape]) -> float:
        if not chunks:
            return 0.0
        if self.expert_load is None:
            return self._combine(self.breakdown(chunks))
        group_tokens = sum(ch.num_new_tokens for ch in chunks) / \
            self.config.num_accelerators * self.ep_size
        factor, moves_s = self.expert_load.step(group_tokens)
        t = self.breakdown(chunks, factor)
        t["overhead"] += moves_s
        seconds = self._combine(t)
        self.expert_load.drift(seconds)
        return seconds

    def step_time_with(self, chunks: Sequence[ChunkShape], imbalance: float
                       ) -> tuple[float, dict[str, float]]:
        """(seconds, breakdown) of one step whose routed experts' busiest rank carries
        `imbalance` times the mean load (a fixed factor instead of `expert_load`'s draws)."""
        parts = self.breakdown(chunks, imbalance)
        return self._combine(parts), parts

    def _combine(self, t: dict[str, float]) -> float:
        compute, comm = t["linear"] + t["attention"], t["all_to_all"]
        share = self.config.overlap_share
        if share == 1.0:
            return max(compute, comm) + t["overhead"]
        if share == 0.0:
            return compute + comm + t["overhead"]
        return compute + comm - share * min(compute, comm) + t["overhead"]

    def _local_expert_bytes(self, tokens_per_gpu: float) -> float:
        """Routed-expert bytes one GPU reads: its experts that any token of the group touches."""
        m = self.model
        if not m.is_moe:
            return 0.0
        slots = (m.num_experts + self.config.num_redundant_experts) / self.ep_size
        group_tokens = tokens_per_gpu * self.ep_size
        touched = 1.0 - (1.0 - m.num_experts_per_tok / m.num_experts) ** group_tokens
        return slots * touched * expert_bytes_per_layer(m, self.config) * m.num_moe_layers

    def _all_to_all_s(self, tokens_per_gpu: float, imbalance: float = 1.0) -> float:
        m, a, c = self.model, self.accel, self.config
        if not m.is_moe or self.ep_size <= 1 or tokens_per_gpu <= 0:
            return 0.0
        dispatch = (c.dispatch_bytes_per_value if c.dispatch_bytes_per_value is not None
                    else m.dispatch_bytes_per_value)
        per_value = dispatch + m.combine_bytes_per_value
        k = m.num_experts_per_tok
        num_nodes = max(1, -(-self.ep_size // a.gpus_per_node))
        if c.node_dedup and num_nodes > 1:
            # Distinct nodes a token's k experts sit on (capped by node-limited routing);
            # the NIC carries one copy per remote node, NVLink fans it out to the experts.
            nodes = num_nodes * (1.0 - (1.0 - 1.0 / num_nodes) ** k)
            if m.max_nodes_per_token:
                nodes = min(nodes, m.max_nodes_per_token)
            remote_sends = nodes * (num_nodes - 1) / num_nodes
            nvlink_sends = k
        elif c.ep_collective == "all-gather":
            # Every rank gathers every token and reduce-scatters the partial outputs: EP - 1
            # copies per token whatever the routing, so the load skew does not lengthen it.
            remote_sends = max(0, self.ep_size - a.gpus_per_node)
            nvlink_sends = min(self.ep_size, a.gpus_per_node) - 1
            imbalance = 1.0
        else:
            # One copy per (token, expert) pair; pairs whose expert is on this GPU stay home.
            remote_sends = k * max(0, self.ep_size - a.gpus_per_node) / self.ep_size
            nvlink_sends = k * (min(self.ep_size, a.gpus_per_node) - 1) / self.ep_size
        # The busiest rank receives (and returns) `imbalance` times the mean rank's pairs.
        unit = tokens_per_gpu * m.hidden_size * per_value * imbalance
        # NVLink and the NIC carry their shares at the same time (DeepEP-style).
        seconds = max(unit * remote_sends / (a.network_bytes_per_s * c.net_eff),
                      unit * nvlink_sends / (a.nvlink_bytes_per_s * c.net_eff))
        return m.num_moe_layers * (seconds + 2 * c.a2a_latency_s)

def kv_cache_blocks(model: AnalyticModel, accel: AcceleratorSpec, config: RooflineConfig,
                    block_size: int, reserved_fraction: float = 0.15) -> int:
    """KV blocks a worker's HBM holds after its weights (dense part on every GPU, its share of
    the routed experts) and `reserved_fraction` of HBM for activations and buffers."""
    ep = config.ep_size or config.num_accelerators
    experts_per_gpu = (model.num_experts + config.num_redundant_experts) / ep if model.is_moe else 0
    weights = model.dense_weight_bytes + experts_per_gpu * expert_bytes_per_layer(model, config) * \
        model.num_moe_layers
    free = accel.hbm_bytes * (1.0 - reserved_fraction) - weights
    if free <= 0:
        raise ValueError(f"{model.name} does not fit {accel.name} with EP {ep}")
    return int(free * config.num_accelerators // (model.kv_bytes_per_token * block_size))
