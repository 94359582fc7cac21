"""Each EP rank loads only the routed experts of its own physical slots (and the replicas the
initial layout puts there), not the whole checkpoint: its parameters are exactly the non-expert
weights plus slots_per_rank experts per MoE layer, every slot equals that expert of the full
model, and the expert tensors of experts held elsewhere are dropped while streaming.
(Outputs of rank processes loaded this way equal one process: test_expert_parallel_equality,
test_ep_decode_group.)"""
from __future__ import annotations

import pytest
import torch

from deepinfer.ep.rank_weights import RankExpertLoader, load_rank_model
from deepinfer.moe.ep_experts import ExpertParallelExperts
from deepinfer.moe.expert_parallel import ExpertParallelRuntime
from deepinfer.moe.layer import SparseMoEBlock
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.expert_parallel_harness import write_checkpoint


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("world, redundant", [(2, 2), (4, 0)])
def test_rank_holds_only_its_slots_experts(kind, world, redundant, tmp_path,
                                           default_model_source, monkeypatch):
    directory = write_checkpoint(kind, tmp_path, seed=3,
                                 tokenizer=default_model_source.load_tokenizer())
    source = resolve_model(directory)
    full = load_model(source, torch.float32, "cpu")
    full_params = dict(full.named_parameters())
    blocks = [name for name, m in full.named_modules() if isinstance(m, SparseMoEBlock)]
    first = full.get_submodule(blocks[0]).experts
    num_experts = first.gate_up_proj.shape[0]
    per_expert = first.gate_up_proj[0].numel() + first.down_proj[0].numel()
    dropped = []
    original_check = RankExpertLoader.check_filled

    def record(loader):
        dropped.append(loader.num_tensors_dropped)
        original_check(loader)
    monkeypatch.setattr(RankExpertLoader, "check_filled", record)

    for rank in range(world):
        model, runtime = load_rank_model(source, torch.float32, torch.device("cpu"),
                                         lambda m: ExpertParallelRuntime(
                                             m, rank, world, num_redundant_experts=redundant,
                                             load_slots=False))
        slots = (num_experts + redundant) // world
        # Memory: the non-expert weights plus this rank's slots, nothing of the full stacks.
        total = sum(p.numel() for p in model.parameters())
        assert total == sum(p.numel() for p in full.parameters()) \
            - len(blocks) * (num_experts - slots) * per_expert
        for block in blocks:
            layer = model.get_submodule(block).experts
            assert isinstance(layer, ExpertParallelExperts)
            assert layer.gate_up_proj.shape[0] == slots
            held = layer.phy2log[layer.local_slot_range.start:layer.local_slot_range.stop]
            for slot, expert in enumerate(held):
                for param in ("gate_up_proj", "down_proj"):
                    want = full_params[f"{block}.experts.{param}"][expert]
                    assert torch.equal(getattr(layer, param)[slot], want), (block, slot, param)
        for name, param in model.named_parameters():
            if ".experts." not in name or "shared" in name:
                assert torch.equal(param, full_params[name]), name
        # Streaming dropped the tensors of experts this rank holds no slot of (3 per expert
        # per layer in these per-expert checkpoints).
        distinct = len(set(runtime.layers[0].phy2log[slots * rank:slots * (rank + 1)].tolist()))
        assert dropped[-1] == len(blocks) * (num_experts - distinct) * 3
