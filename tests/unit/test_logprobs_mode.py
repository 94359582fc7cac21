"""--logprobs-mode (vLLM's): what a request's logprobs report. raw_logprobs (the default) is
the log-softmax of the model's own logits, whatever the request's penalties, bias, masks,
temperature or truncation; processed_* are those of the distribution the token was drawn
from. The mode never changes the sampled token; speculation reports what plain decoding does."""
from __future__ import annotations

import pytest
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.runtime.sampler import Sampler, truncate_logits
from deepinfer.sampling_params import LOGPROBS_MODES, SamplingParams
from deepinfer.spec.verifier import SpecVerifier

V = 40
CPU = torch.device("cpu")
PROMPT = [1, 2, 5, 9]
K = 5

# Every processing step changes the logits: penalties and bias (greedy) and, for the random
# row, temperature and top-k truncation on top.
GREEDY = SamplingParams(temperature=0.0, logprobs=K, repetition_penalty=1.5,
                        frequency_penalty=0.8, logit_bias={3: 4.0, 11: -7.0})
RANDOM = SamplingParams(temperature=0.6, top_k=8, seed=5, logprobs=K, presence_penalty=1.0,
                        logit_bias={7: 3.0}, min_tokens=2, stop_token_ids=[4])


def row(params: SamplingParams, output: list[int], rid: str = "r", **kw) -> ScheduledRequest:
    history = PROMPT + output
    return ScheduledRequest(rid, [history[-1]], len(history) - 1, [0], True, params, len(output),
                            history_token_ids=list(history), **kw)


def model_logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def processed(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    out = logits.clone()
    Sampler.process_logits(out, rows)
    return out


def expected_values(mode: str, raw: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    """Row by row, from the definitions."""
    out = []
    for i, r in enumerate(rows):
        values = raw[i].clone() if mode.startswith("raw") else processed(raw[i:i + 1], [r])[0]
        p = r.sampling_params
        if mode.startswith("processed") and not p.greedy:
            values = truncate_logits((values / p.temperature).unsqueeze(0), [p])[0]
        out.append(torch.log_softmax(values, -1) if mode.endswith("logprobs") else values)
    return torch.stack(out)


def check(lp, token: int, want: torch.Tensor) -> None:
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(float(want[token]), abs=1e-5)
    top = want.topk(K)
    assert lp.top_token_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values)
    assert lp.rank == int((want > want[token]).sum()) + 1


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_each_mode_reports_its_definition(mode):
    raw = model_logits(3)
    rows = [row(GREEDY, [3, 3, 7], "g"), row(RANDOM, [7], "s"),
            row(SamplingParams(temperature=0.0), [2], "plain")]  # asks for no logprobs
    tokens, logprobs = Sampler(CPU, logprobs_mode=mode).sample(raw.clone(), rows)
    want = expected_values(mode, raw, rows)
    check(logprobs["g"], tokens[0], want[0])
    check(logprobs["s"], tokens[1], want[1])
    assert "plain" not in logprobs


def test_raw_is_the_model_output_and_processed_is_not():
    """The processing really moves the numbers (else the test above proves nothing)."""
    raw = model_logits(1)
    top = int(raw[0].argmax())
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={top: -20.0})
    by_mode = {m: Sampler(CPU, logprobs_mode=m).sample(raw.clone(), [row(params, [3])])[1]["r"]
               for m in ("raw_logprobs", "processed_logprobs")}
    token = by_mode["raw_logprobs"].token_id
    assert token != top and by_mode["processed_logprobs"].token_id == token
    assert by_mode["raw_logprobs"].logprob == pytest.approx(
        float(torch.log_softmax(raw[0], -1)[token]), abs=1e-6)
    assert by_mode["raw_logprobs"].rank == 2 and by_mode["processed_logprobs"].rank == 1
    assert by_mode["raw_logprobs"].top_token_ids[0] == top  # the model's favourite, unbiased


def test_default_mode_is_raw_logprobs():
    assert Sampler(CPU).logprobs_mode == "raw_logprobs" == LOGPROBS_MODES[0]
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(CPU, logprobs_mode="logprobs")


def test_the_mode_never_changes_the_token():
    raw = model_logits(2, seed=3)
    rows = [row(GREEDY, [3, 3]), row(RANDOM, [7, 7], "s")]
    tokens = {m: Sampler(CPU, logprobs_mode=m).sample(raw.clone(), rows)[0] for m in LOGPROBS_MODES}
    assert len({tuple(t) for t in tokens.values()}) == 1


def test_raw_keeps_nothing_when_no_row_asks():
    """The raw rows are copied only for requests that ask for log-probs."""
    sampler = Sampler(CPU)
    plain = row(SamplingParams(temperature=0.0, presence_penalty=1.0), [3])
    assert sampler.keep_raw(model_logits(1), [plain]) is None
    kept = sampler.keep_raw(model_logits(2), [plain, row(GREEDY, [3], "g")])
    assert kept.rows == [1] and kept.values.shape == (1, V)
    assert Sampler(CPU, logprobs_mode="processed_logprobs").keep_raw(
        model_logits(1), [row(GREEDY, [3])]) is None


class _NoDrafter:
    def take_draft_probs(self, request_id, draft_token_ids):
        return None


class _PositionModel:
    """Logits that depend on the row's position (its hidden state), as a real model's do."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # [positions, V]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table[hidden[:, 0].long()].clone()


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@pytest.mark.parametrize("params", [GREEDY, RANDOM], ids=["greedy", "seeded"])
def test_speculation_reports_what_plain_decoding_does(mode, params):
    """A verification of the drafts plain decoding would produce gives, position by position,
    the tokens and log-probs of plain decoding, in every mode."""
    steps = 4
    table = model_logits(steps, seed=11)
    plain_tokens, plain_lps, output = [], [], [7]
    for j in range(steps):
        tokens, lps = Sampler(CPU, logprobs_mode=mode).sample(table[j:j + 1].clone(),
                                                              [row(params, output)])
        plain_tokens.append(tokens[0])
        plain_lps.append(lps["r"])
        output = output + tokens

    drafts = plain_tokens[:steps - 1]
    r = ScheduledRequest("r", [7] + drafts, len(PROMPT), [0], True, params, 1,
                         num_draft_tokens=len(drafts), history_token_ids=PROMPT + [7])
    hidden = torch.arange(steps, dtype=torch.float32).unsqueeze(1).repeat(1, 4)  # row = position
    result = SpecVerifier(Sampler(CPU, logprobs_mode=mode), _NoDrafter()).sample(
        _PositionModel(table), hidden, [r])
    assert result.verified_token_ids["r"] == plain_tokens
    for got, want in zip(result.verified_logprobs["r"], plain_lps):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert got.top_token_ids == want.top_token_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        torch.testing.assert_close(torch.tensor(got.top_logprobs), torch.tensor(want.top_logprobs))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_flag_reaches_the_engine_config(command):
    from deepinfer.engine.engine_args import engine_config_from_args
    from deepinfer.cli.main import build_parser
    extra = ["hi"] if command == "generate" else []
    args = build_parser().parse_args([command, *extra])
    assert engine_config_from_args(args).logprobs_mode == "raw_logprobs"
    args = build_parser().parse_args([command, *extra, "--logprobs-mode", "processed_logits"])
    assert engine_config_from_args(args).logprobs_mode == "processed_logits"
    with pytest.raises(SystemExit) as e:  # one line, exit 2
        build_parser().parse_args([command, *extra, "--logprobs-mode", "processed"])
    assert e.value.code == 2


def test_engine_config_refuses_an_unknown_mode():
    from deepinfer.engine.engine_config import EngineConfig
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig(logprobs_mode="raw")
