"""Load one EP rank's model: every non-expert weight, and of the routed experts only those its
physical slots hold (plus the replicas EPLB put there), not the whole checkpoint.

    build model ─▶ swap each MoE layer's experts for this rank's (empty) slots ─▶ stream the
    checkpoint: expert tensors of experts in no local slot are dropped, the others copied into
    every local slot that holds them (a replica fills each of its slots); the rest as usual

The full expert stacks of the built model are never filled and are dropped by the swap (on the
CPU their pages are never touched). Later moves at rebalance come from peers
(moe/rebalancer.py), which hold every expert between them.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from deepinfer.moe.ep_experts import ExpertParallelExperts


def load_rank_model(source, dtype: torch.dtype, device: torch.device, make_runtime):
    """(model, runtime): `make_runtime(model)` builds the ExpertParallelRuntime (with
    `load_slots=False`), which swaps the MoE layers for this rank's slots; then the weights."""
    from deepinfer.models.registry import build_model
    from deepinfer.models.weight_mapping import load_hf_named_weights

    with torch.device(device):
        model = build_model(source.config, dtype)
    runtime = make_runtime(model)
    layers = {f"{name}.": module for name, module in model.named_modules()
              if isinstance(module, ExpertParallelExperts)}
    if source.config.quantization is not None:  # FP8: the slots take their experts' FP8 weights
        from deepinfer.models.fp8_checkpoint import load_fp8_weights
        load_fp8_weights(model, source.checkpoint, source.config.quantization,
                         skip_prefixes=tuple(layers))
        if device.type == "cpu":
            from deepinfer.runtime.cpu_quant_linear import install_quant_kernels, load_quant_linear
            install_quant_kernels(model)
            kernel = load_quant_linear()
            for layer in layers.values():
                layer.kernel = kernel
        return model.eval(), runtime
    loader = RankExpertLoader(source.config, layers)
    with torch.no_grad():
        load_hf_named_weights(model, loader.filter(source.iter_weights()),
                              skip_prefixes=tuple(layers))
    loader.check_filled()
    return model.eval(), runtime


class RankExpertLoader:
    """Routes routed-expert tensors of the EP layers into their local slots; passes the rest."""

    def __init__(self, config, layers: dict[str, ExpertParallelExperts]) -> None:
        self.config = config
        self.layers = layers  # "model.layers.3.mlp.experts." -> layer
        self.filled = {(prefix, p): 0 for prefix in layers for p in ("gate_up_proj", "down_proj")}
        self.num_tensors_dropped = 0  # expert tensors of experts this rank holds no slot of

    def filter(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        from deepinfer.models.moe_weight_mapping import expert_shard_target, normalize_moe_name

        for name, tensor in weights:
            target = expert_shard_target(normalize_moe_name(name), self.config)
            prefix, _, param = target.param_name.rpartition(".") if target else ("", "", "")
            layer = self.layers.get(prefix + ".") if target else None
            if layer is None:
                yield name, tensor
                continue
            self._copy(prefix + ".", layer, param, target, tensor, name)

    def _copy(self, prefix: str, layer: ExpertParallelExperts, param: str, target,
              tensor: Tensor, name: str) -> None:
        dest_all = getattr(layer, param).data  # [slots_per_rank, rows, cols]
        start = layer.local_slot_range.start
        local = layer.phy2log[start:start + layer.slots_per_rank]
        slots = range(layer.slots_per_rank) if target.expert_id is None else \
            [i for i, e in enumerate(local) if e == target.expert_id]
        if not slots:
            self.num_tensors_dropped += 1
            return
        for slot in slots:
            source = tensor if target.expert_id is not None else tensor[int(local[slot])]
            dest = dest_all[slot]
            if target.num_rows is not None:
                dest = dest.narrow(0, target.row_offset, target.num_rows)
            if tuple(source.shape) != tuple(dest.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, "
                                 f"expected {tuple(dest.shape)} per expert")
            dest.copy_(source)
            self.filled[(prefix, param)] += dest.numel()

    def check_filled(self) -> None:
        """ValueError naming the first slot parameter the checkpoint did not fill entirely."""
        for (prefix, param), count in self.filled.items():
            if count != getattr(self.layers[prefix], param).numel():
                raise ValueError(f"checkpoint is missing expert weights for {prefix}{param}")
