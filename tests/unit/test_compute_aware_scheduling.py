"""The real Scheduler driven by a compute-aware budget and a synthetic cost model, with fake
step results: steps fit the time budget, long prompts' chunks shrink as their context grows,
and every request finishes. Pure and fast."""
from __future__ import annotations

import random

import pytest

from deepinfer.core.compute_budget import ComputeAwarePolicy
from deepinfer.core.cost_model import ChunkShape, CostModel
from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.model_shape import ModelShape
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import SchedulerOutput, StepResult
from deepinfer.sampling_params import SamplingParams

SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                   active_params=106_168_320, kv_bytes_per_token=23_040,
                   weight_bytes=269_000_000)
MODEL = CostModel(SHAPE, {"linear_flops": 2e-12, "attention_flops": 6e-12,
                          "bytes_moved": 1e-10, "num_requests": 3e-4, "step": 4e-3})
BLOCK_SIZE = 16
MIN_CHUNK = 32


def make_scheduler(budget_s: float, num_blocks: int = 4096, max_num_seqs: int = 64
                   ) -> Scheduler:
    policy = ComputeAwarePolicy(MODEL, budget_s, block_size=BLOCK_SIZE,
                                min_chunk_tokens=MIN_CHUNK)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=16_384),
                     KVCacheManager(num_blocks, BLOCK_SIZE), policy)


def make_request(request_id: str, prompt_len: int, max_tokens: int, seed: int) -> Request:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 30_000) for _ in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))


def fake_result(output: SchedulerOutput) -> StepResult:
    return StepResult({s.request_id: 7 for s in output.scheduled if s.sample},
                      step_time_s=output.predicted_step_time_s or 0.0)


def assert_step_within_budget(output: SchedulerOutput, budget_s: float) -> None:
    """Predicted time <= budget, unless decodes plus one minimum first chunk pushed it over."""
    chunks = [ChunkShape(s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled]
    assert output.predicted_step_time_s == pytest.approx(MODEL.predict(chunks), rel=1e-9)
    if output.predicted_step_time_s <= budget_s * (1 + 1e-9):
        return
    prefills = [c for c in chunks if c.num_new_tokens > 1]
    decode_time = MODEL.predict([c for c in chunks if c.num_new_tokens == 1])
    assert len(prefills) <= 1, f"over budget with {len(prefills)} prefill chunks"
    assert all(c.num_new_tokens <= MIN_CHUNK for c in prefills)
    if not prefills:
        assert decode_time > budget_s


def run_to_completion(scheduler: Scheduler, budget_s: float, max_steps: int = 20_000
                      ) -> list[SchedulerOutput]:
    outputs = []
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        output = scheduler.schedule(now=float(step))
        assert not output.is_empty, "a step with unfinished requests scheduled nothing"
        assert_step_within_budget(output, budget_s)
        scheduler.update(output, fake_result(output))
        scheduler.check_invariants()
        outputs.append(output)
    raise AssertionError("requests did not finish")


def test_long_prompt_chunks_shrink_as_its_context_grows():
    scheduler = make_scheduler(budget_s=0.2)
    scheduler.add_request(make_request("long", 12_000, max_tokens=2, seed=0))
    outputs = run_to_completion(scheduler, 0.2)
    chunks = [(s.num_computed_tokens, s.num_new_tokens) for o in outputs for s in o.scheduled
              if s.num_new_tokens > 1]
    sizes = [x for _, x in chunks[:-1]]  # the last chunk is just the prompt's remainder
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] < sizes[0] / 2
    assert all((p + x) % BLOCK_SIZE == 0 for p, x in chunks[:-1])
    assert sum(x for _, x in chunks) == 12_000


def test_decodes_keep_running_while_a_long_prompt_prefills():
    budget_s = 0.15
    scheduler = make_scheduler(budget_s)
    decoding: set[str] = set()  # requests that have their first token and are not finished

    def step(now: float) -> SchedulerOutput:
        output = scheduler.schedule(now)
        assert_step_within_budget(output, budget_s)
        update = scheduler.update(output, fake_result(output))
        decoding.update(update.new_token_ids)
        decoding.difference_update(r.request_id for r in update.finished)
        scheduler.check_invariants()
        return output

    for i in range(8):
        scheduler.add_request(make_request(f"chat{i}", 40, max_tokens=200, seed=i))
    now = 0.0
    while len(decoding) < 8:
        now += 1
        step(now)
    # The long prompt is admitted after the chats: its chunks run beside their decodes.
    scheduler.add_request(make_request("long", 6000, max_tokens=4, seed=99))
    num_long_steps = 0
    while scheduler.has_unfinished_requests():
        before = set(decoding)
        now += 1
        output = step(now)
        if any(s.request_id == "long" and s.num_new_tokens > 1 for s in output.scheduled):
            num_long_steps += 1
            assert before - {"long"} <= {s.request_id for s in output.scheduled}
            assert output.predicted_step_time_s <= budget_s * (1 + 1e-9)
    assert num_long_steps > 3  # the prompt was chunked


def drive_random_workload(scheduler: Scheduler, rng: random.Random, seed: int,
                          check_step) -> None:
    """Requests arrive over time; step with fake results until all finish (asserted)."""
    pending = []
    for i in range(rng.randint(5, 25)):
        prompt_len = rng.choice([rng.randint(1, 200), rng.randint(500, 3500)])
        pending.append((rng.randint(0, 60), make_request(f"r{i}", prompt_len,
                                                         rng.randint(1, 40), seed * 100 + i)))
    ids = {r.request_id for _, r in pending}
    finished: set[str] = set()
    for step in range(20_000):
        for arrival, request in [p for p in pending if p[0] <= step]:
            scheduler.add_request(request)
            pending.remove((arrival, request))
        if not pending and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule(now=float(step))
        if output.is_empty:
            assert not scheduler.has_unfinished_requests()
            continue
        check_step(output)
        update = scheduler.update(output, fake_result(output))
        finished.update(r.request_id for r in update.finished)
        scheduler.check_invariants()
    assert finished == ids


@pytest.mark.parametrize("seed", range(6))
def test_randomized_workloads_fit_budget_and_all_requests_finish(seed):
    rng = random.Random(seed)
    budget_s = rng.choice([0.02, 0.05, 0.1, 0.3])
    scheduler = make_scheduler(budget_s, num_blocks=rng.choice([300, 2000]),
                               max_num_seqs=rng.choice([4, 16, 64]))
    drive_random_workload(scheduler, rng, seed,
                          lambda output: assert_step_within_budget(output, budget_s))


def test_small_kv_cache_preempts_and_still_finishes_everything():
    preemptions = 0
    for seed in range(4):
        rng = random.Random(seed)
        scheduler = make_scheduler(0.3, num_blocks=260, max_num_seqs=64)
        drive_random_workload(scheduler, rng, seed,
                              lambda output: assert_step_within_budget(output, 0.3))
        preemptions += scheduler.num_preemptions
    assert preemptions > 0  # the workloads really exercised preemption


def test_scheduler_feeds_measured_times_back_so_steps_fit_a_slower_device():
    budget_s = 0.1
    scheduler = make_scheduler(budget_s)

    def run_steps(num_steps: int) -> list[tuple[SchedulerOutput, float]]:
        steps = []
        for _ in range(num_steps):
            if not scheduler.has_unfinished_requests():
                break
            output = scheduler.schedule(0.0)
            # The device is 1.4x slower than the cost model says.
            true_time = 1.4 * MODEL.predict([ChunkShape(s.num_computed_tokens, s.num_new_tokens)
                                             for s in output.scheduled])
            scheduler.update(output, StepResult({s.request_id: 7 for s in output.scheduled
                                                 if s.sample}, step_time_s=true_time))
            steps.append((output, true_time))
        return steps

    scheduler.add_request(make_request("first", 3000, max_tokens=2, seed=8))
    uncalibrated = run_steps(1)
    assert uncalibrated[0][1] > budget_s * 1.3  # the first chunk overran by the whole factor
    for i in range(6):
        scheduler.add_request(make_request(f"chat{i}", 60, max_tokens=300, seed=i))
    run_steps(80)  # decodes calibrate the policy
    assert scheduler.budget_policy.time_scale == pytest.approx(1.4, rel=0.02)
    scheduler.add_request(make_request("long", 3000, max_tokens=2, seed=9))
    chunked = [t for out, t in run_steps(200)
               if any(s.request_id == "long" and s.num_new_tokens > MIN_CHUNK
                      for s in out.scheduled)]
    assert len(chunked) >= 3 and max(chunked) <= budget_s * 1.02
