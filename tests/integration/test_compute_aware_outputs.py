"""Compute-aware scheduling changes how prompts are chunked, never what is generated: greedy
outputs equal the token-budget engine's on the default model. Budget: ~20 s idle."""
from __future__ import annotations

import json
import random

import pytest

from deepinfer import SamplingParams
from deepinfer.core.cost_model import CostModel
from deepinfer.core.model_shape import ModelShape
from tests.integration.engine_checks import generate_checked, token_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def synthetic_profile(tmp_path_factory, engine_base_llm):
    """A cost profile with made-up (but plausible) coefficients: which chunks the policy picks
    depends on them, the outputs must not. No profiling run needed."""
    shape = ModelShape.from_model_config(engine_base_llm.engine.model_config, dtype_bytes=4)
    model = CostModel(shape, {"linear_flops": 5e-12, "attention_flops": 1.2e-10,
                              "bytes_moved": 2e-11, "num_requests": 5e-4, "step": 5e-3})
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(json.dumps(model.to_dict()))
    return str(path), model


def record_chunks(llm) -> list[list[tuple[str, int, int]]]:
    """Spy on the scheduler: (request, context, new tokens) of every scheduled step."""
    steps: list[list[tuple[str, int, int]]] = []
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def schedule(now):
        out = original(now)
        steps.append([(s.request_id, s.num_computed_tokens, s.num_new_tokens)
                      for s in out.scheduled])
        return out

    scheduler.schedule = schedule
    return steps


def test_greedy_outputs_equal_token_budget(make_engine_llm, synthetic_profile):
    path, cost_model = synthetic_profile
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in (400, 9, 60)]
    token_budget = make_engine_llm(scheduler="token-budget", max_num_batched_tokens=2048)
    compute_aware = make_engine_llm(scheduler="compute-aware", step_time_budget_ms=300.0,
                                    cost_profile=path, max_num_batched_tokens=4096)
    steps = record_chunks(compute_aware)
    expected = generate_checked(token_budget, token_prompts(prompts), GREEDY)
    got = generate_checked(compute_aware, token_prompts(prompts), GREEDY)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"prompt {i} differs"
    # The policy really chunked: the 400-token prompt took several chunks that shrank as its
    # context grew.
    long_id = got[0].request_id
    chunks = [(p, x) for step in steps for r, p, x in step if r == long_id and x > 1]
    assert len(chunks) >= 3 and sum(x for _, x in chunks) == 400
    assert chunks[-2][1] < chunks[0][1]
    # Every compute-aware step carried a prediction, and the engine accounts its error.
    stats = compute_aware.engine.get_stats()
    assert stats.num_predicted_steps == len(steps) > 0
    assert 0.0 < stats.prediction_abs_error_sum < float("inf")
    assert token_budget.engine.get_stats().num_predicted_steps == 0
