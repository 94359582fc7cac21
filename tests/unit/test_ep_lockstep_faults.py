"""A rank whose forward raises part-way joins the MoE collectives it did not reach (with no
tokens), so its peers' forwards complete; a fault inside a layer's dispatch/combine cannot be
matched and is reported as such (the group is then restarted)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer.moe.moe_config import MoEConfig
from deepinfer.moe.expert_parallel import ExpertParallelRuntime
from deepinfer.moe.layer import SparseMoEBlock

E, H, I, K, LAYERS = 8, 16, 12, 2, 4


class Model(nn.Module):
    """MoE blocks in a row; `fail_after` raises (as attention might) after that many blocks."""

    def __init__(self) -> None:
        super().__init__()
        config = MoEConfig(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I)
        self.blocks = nn.ModuleList(SparseMoEBlock(config, H, torch.float32) for _ in range(LAYERS))
        self.fail_after: int | None = None

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == self.fail_after:
                raise RuntimeError("attention failed")
            x = x + block(x)
        return x


def counting_runtime():
    torch.manual_seed(0)
    model = Model()
    runtime = ExpertParallelRuntime(model, 0, 1)
    calls = []  # (layer, tokens) per dispatch, in order
    for index, layer in enumerate(runtime.layers):
        dispatch = layer.dispatcher.dispatch

        def counted(hidden, slots, weights, index=index, dispatch=dispatch):
            calls.append((index, hidden.shape[0]))
            return dispatch(hidden, slots, weights)
        layer.dispatcher = type("Counted", (), {"dispatch": staticmethod(counted),
                                                "combine": layer.dispatcher.combine})()
    return model, runtime, calls


@pytest.mark.parametrize("fail_after", [0, 2, LAYERS])
def test_a_forward_that_raises_joins_the_layers_it_missed(fail_after):
    model, runtime, calls = counting_runtime()
    model.fail_after = fail_after if fail_after < LAYERS else None
    runtime.begin_forward()
    try:
        model(torch.randn(5, H))
    except RuntimeError:
        pass
    assert runtime.finish_failed_forward()
    # Every layer's collectives ran exactly once, in order: the layers reached with this
    # rank's 5 tokens, the others empty.
    assert calls == [(i, 5 if i < fail_after else 0) for i in range(LAYERS)]
    runtime.discard_step_loads()  # the failed step counts no load
    assert all(int(layer.slot_load.sum()) == 0 for layer in runtime.layers)


def test_a_fault_inside_a_collective_cannot_be_matched():
    model, runtime, calls = counting_runtime()
    layer = runtime.layers[1]

    def broken(batch, dtype):
        raise RuntimeError("expert kernel failed")
    layer.compute = broken  # between the layer's dispatch and its combine
    runtime.begin_forward()
    with pytest.raises(RuntimeError, match="expert kernel"):
        model(torch.randn(5, H))
    assert not runtime.finish_failed_forward()
    assert [i for i, _ in calls] == [0, 1]  # nothing more was run


def test_pinning_stops_at_a_fault_that_breaks_the_lockstep():
    """While a rank re-runs its requests one at a time to pin a fault, a probe that breaks the
    group's collectives is not blamed on a request: it ends the rank (the group is restarted)."""
    from deepinfer.core.scheduler_output import SchedulerOutput
    from deepinfer.engine.step_faults import pin_step_fault
    from deepinfer.ep.lockstep_faults import LockstepBroken

    class Sched:
        def __init__(self, rid):
            self.request_id, self.num_new_tokens = rid, 1

    output = SchedulerOutput([Sched("a"), Sched("b")], 2)

    def execute(alone):
        if alone.scheduled[0].request_id == "b":
            raise LockstepBroken("step failed inside an MoE collective")
        raise RuntimeError("a's fault")
    with pytest.raises(LockstepBroken):
        pin_step_fault(execute, output, RuntimeError("step failed"))
    def a_fails(alone):
        return None if alone.scheduled[0].request_id == "b" else execute(alone)
    assert pin_step_fault(a_fails, output, RuntimeError("x")) == {"a": "RuntimeError: a's fault"}
