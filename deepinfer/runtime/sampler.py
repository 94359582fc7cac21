"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Random rows sample by the exponential race (argmax of p / E with E ~ Exp(1)), which equals
multinomial sampling. A seeded request draws the noise for output position i from a generator
seeded with a hash of (seed, i): the draw is a pure function of (seed, i), so it does not depend
on the rest of the batch, on a preemption (which recomputes and resumes at the same position),
or on which worker samples it (a decode worker continues at the position the prefill worker's
token left). Unseeded rows share the sampler's own generator.

Speculative decoding samples several positions of one request in one step: `sample_rows` takes
one row per position (a ScheduledRequest whose `num_output_tokens` is that row's output
position), so every position keeps its own (seed, i) noise and min_tokens mask.

Log-probs follow vLLM's `--logprobs-mode` (`LOGPROBS_MODES`): by default (`raw_logprobs`) the
log-softmax of the model's own logits, before any of the request's processing; `raw_logits`
the logits themselves; `processed_logprobs` / `processed_logits` those of the distribution the
token was drawn from (after logit processing and, for a random row, temperature and
min_p / top_k / top_p; a greedy row is never scaled or truncated).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest, TokenLogprobs
from deepinfer.core.request_fault import RequestFault
from deepinfer.sampling_params import LOGPROBS_MODES, SamplingParams

_MASK64 = (1 << 64) - 1
# Row argmax in two passes over blocks of this many columns (see `row_argmax`), for batches
# of at least _ARGMAX_MIN_ROWS rows: at batch 1 inside the engine it measured slower than
# torch's argmax (0.19 vs 0.11 ms per step), at 64 rows faster (0.9 vs 2.8 ms).
_ARGMAX_BLOCK = 512
_ARGMAX_MIN_ROWS = 8


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """Generator seed for output token `position` of a request with `seed`. Mixing the seed
    first keeps (seed, i + 1) and (seed + 1, i) apart (n > 1 children use seed + index)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    return mode


@dataclass
class RawRows:
    """Copies of the unprocessed logits of the rows (indices `rows`) that ask for log-probs,
    taken before `process_logits` changes them in place (raw modes only)."""

    rows: list[int]
    values: Tensor  # [len(rows), V]

    def take(self, rows: list[int]) -> Tensor:
        """The kept values of those of `rows` that were kept, in `rows` order."""
        where = {row: i for i, row in enumerate(self.rows)}
        index = [where[r] for r in rows if r in where]
        return self.values[torch.tensor(index, dtype=torch.long, device=self.values.device)]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0,
                 logprobs_mode: str = LOGPROBS_MODES[0]) -> None:
        self.device = device
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self._position_generator = torch.Generator(device=device)  # re-seeded for every row
        # Structured outputs: a deepinfer.runtime.grammar_mask.GrammarMasker (the engine sets
        # it), whose token masks apply first in `process_logits`.
        self.grammar = None

    def sample(self, logits: Tensor, requests: list[ScheduledRequest]
               ) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """logits [N, V] float32, one row per request in `requests`."""
        raw = self.keep_raw(logits, requests)
        self.process_logits(logits, requests, self.grammar)
        token_list = self.sample_tokens(logits, requests).tolist()
        logprobs = self._logprobs(logits, requests, token_list, raw)
        return token_list, logprobs

    def sample_rows(self, logits: Tensor, rows: list[ScheduledRequest]
                    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Like `sample`, but rows may share a request (one row per output position): the
        log-probs come back per row (None where the request asks for none)."""
        raw = self.keep_raw(logits, rows)
        self.process_logits(logits, rows, self.grammar)
        tokens = self.sample_tokens(logits, rows).tolist()
        return tokens, self.row_logprobs(logits, rows, tokens, None if raw is None else raw.values)

    def keep_raw(self, logits: Tensor, rows: list[ScheduledRequest]) -> RawRows | None:
        """Call before `process_logits`: in a raw mode, a copy of the rows that ask for
        log-probs; None otherwise (no row asks: nothing is copied)."""
        if not self.logprobs_mode.startswith("raw"):
            return None
        wanted = [i for i, r in enumerate(rows) if r.sampling_params.logprobs is not None]
        if not wanted:
            return None
        # The gather copies; row_logprobs would gather these rows anyway.
        index = torch.tensor(wanted, dtype=torch.long, device=logits.device)
        return RawRows(wanted, logits.index_select(0, index))

    def sample_tokens(self, logits: Tensor, requests: list[ScheduledRequest]) -> Tensor:
        """[N] long: greedy rows by argmax, the others by the exponential race (logits
        already masked for min_tokens)."""
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        rand = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if len(greedy) == len(requests):
            tokens = row_argmax(logits)  # all greedy: no row gather (a full logits copy)
        elif greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = row_argmax(logits[idx])
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            tokens[idx] = self._sample_random(logits[idx], [requests[i] for i in rand])
        return tokens

    @staticmethod
    def process_logits(logits: Tensor, rows: list[ScheduledRequest], grammar=None) -> None:
        """In place, before temperature: the structured-output grammar's mask (`grammar`, a
        GrammarMasker), allowed_token_ids, logit_bias, the min_tokens mask, then the
        penalties (vLLM's order). Each row is one output position: its penalties
        count the tokens of its own `history_token_ids` (the scheduler's, plus the drafts
        accepted before it in a verification), never a per-step snapshot."""
        if grammar is not None:
            grammar.apply(logits, rows)
        elif any(r.sampling_params.structured_outputs is not None for r in rows):
            raise RequestFault(sorted({r.request_id for r in rows
                                       if r.sampling_params.structured_outputs is not None}),
                               "structured outputs are not available in this engine")
        for i, r in enumerate(rows):  # a grammar-only row has nothing more to process
            if r.sampling_params.allowed_token_ids is not None or r.sampling_params.logit_bias:
                apply_logit_processing(logits[i], r)
        Sampler.mask_min_tokens(logits, rows)
        if any(r.sampling_params.uses_history for r in rows):
            for i, r in enumerate(rows):
                if r.sampling_params.uses_history:
                    apply_penalties(logits[i], r)
        check_not_all_masked(logits, rows)

    @staticmethod
    def mask_min_tokens(logits: Tensor, requests: list[ScheduledRequest]) -> None:
        for i, r in enumerate(requests):
            params = r.sampling_params
            if r.num_output_tokens < params.min_tokens:
                banned = list(r.eos_token_ids) + list(params.stop_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def _sample_random(self, logits: Tensor, requests: list[ScheduledRequest]) -> Tensor:
        probs = sampling_probs(logits, [r.sampling_params for r in requests])
        noise = self.exponential_noise(requests, probs.shape[1], probs.device)
        return row_argmax(probs / noise)

    def exponential_noise(self, requests: list[ScheduledRequest], vocab_size: int,
                          device: torch.device, stream: int = 0) -> Tensor:
        """[N, V] Exp(1) noise, a seeded row's drawn from (seed, its output position);
        `stream` != 0 gives an independent draw for the same position (e.g. a drafter's)."""
        noise = torch.empty(len(requests), vocab_size, device=device)
        unseeded = []
        for i, r in enumerate(requests):
            seed = r.sampling_params.seed
            if seed is None:
                unseeded.append(i)
            else:
                # The token sampled now is output position num_output_tokens.
                self.seed_position(seed ^ stream, r.num_output_tokens)
                noise[i].exponential_(generator=self._position_generator)
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            noise[idx] = torch.empty(len(unseeded), vocab_size, device=device
                                     ).exponential_(generator=self.default_generator)
        return noise

    def seed_position(self, seed: int, position: int) -> torch.Generator:
        """The per-position generator, seeded for (seed, position)."""
        return self._position_generator.manual_seed(position_seed(seed, position))

    def _logprobs(self, logits: Tensor, requests: list[ScheduledRequest], tokens: list[int],
                  raw: RawRows | None = None) -> dict[str, TokenLogprobs]:
        rows = self.row_logprobs(logits, requests, tokens, None if raw is None else raw.values)
        return {r.request_id: lp for r, lp in zip(requests, rows) if lp is not None}

    def row_logprobs(self, logits: Tensor, requests: list[ScheduledRequest], tokens: list[int],
                     raw: Tensor | None = None) -> list[TokenLogprobs | None]:
        """Log-probs (per `logprobs_mode`) of `tokens[i]` at row i, with its request's top-k
        alternatives; None for rows whose request asks for no log-probs. `logits` are the
        processed rows; `raw` (raw modes) the unprocessed rows of the requests that ask, in
        order (`keep_raw`)."""
        out: list[TokenLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        logp = self._logprob_values(logits, [requests[i] for i in rows], rows, raw)
        k_max = max(requests[i].sampling_params.logprobs for i in rows)
        top_vals, top_ids = logp.topk(max(k_max, 1), dim=-1)
        for j, i in enumerate(rows):
            k = requests[i].sampling_params.logprobs
            token_lp = logp[j, tokens[i]]
            out[i] = TokenLogprobs(
                token_id=tokens[i], logprob=float(token_lp),
                rank=int((logp[j] > token_lp).sum()) + 1,
                top_token_ids=top_ids[j, :k].tolist(), top_logprobs=top_vals[j, :k].tolist())
        return out

    def _logprob_values(self, logits: Tensor, requests: list[ScheduledRequest], rows: list[int],
                        raw: Tensor | None) -> Tensor:
        """[len(rows), V]: the values the mode reports for those rows."""
        mode = self.logprobs_mode
        if mode.startswith("raw"):
            if raw is None or raw.shape[0] != len(rows):
                raise ValueError(f"logprobs_mode {mode}: the raw logits of the {len(rows)} rows "
                                 f"that ask for log-probs were not kept (Sampler.keep_raw)")
            values = raw
        else:
            values = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
            random = [j for j, r in enumerate(requests) if not r.sampling_params.greedy]
            if random:  # what the token was drawn from: temperature, then truncation
                params = [requests[j].sampling_params for j in random]
                temps = torch.tensor([p.temperature for p in params], dtype=values.dtype,
                                     device=values.device)
                index = torch.tensor(random, dtype=torch.long, device=values.device)
                values[index] = truncate_logits(values[index] / temps.unsqueeze(1), params)
        return torch.log_softmax(values, dim=-1) if mode.endswith("logprobs") else values


def check_not_all_masked(logits: Tensor, rows: list[ScheduledRequest]) -> None:
    """A row whose every logit the request's own options masked (allowed_token_ids all banned
    by bad_words, or all EOS/stop ids under min_tokens) has no token to give: argmax would
    return token 0, a token the request excluded. Fail that request instead (the step's other
    requests go on)."""
    masked = [i for i, r in enumerate(rows)
              if r.sampling_params.processes_logits or r.sampling_params.min_tokens > 0]
    if not masked:
        return
    # A row is all -inf exactly when its maximum is -inf (a NaN maximum is not): one
    # vectorised read of the rows, no copy of them and no [rows, V] bool tensor.
    if 2 * len(masked) >= len(rows):
        row_max = logits.amax(dim=-1)[torch.tensor(masked, dtype=torch.long, device=logits.device)]
    else:
        index = torch.tensor(masked, dtype=torch.long, device=logits.device)
        row_max = logits.index_select(0, index).amax(dim=-1)
    empty = torch.isneginf(row_max).tolist()
    culprits = sorted({rows[i].request_id for i, e in zip(masked, empty) if e})
    if culprits:
        raise RequestFault(culprits, "every token is excluded by this request's sampling "
                           "options (structured outputs, allowed_token_ids, bad_words, "
                           "min_tokens): nothing to sample")


def apply_logit_processing(row: Tensor, r: ScheduledRequest) -> None:
    """allowed_token_ids, then logit_bias, on one [V] logits row in place."""
    params = r.sampling_params
    if params.allowed_token_ids is not None:
        keep = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=row.device)
        kept = row[keep]
        row.fill_(float("-inf"))
        row[keep] = kept
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)


def apply_penalties(row: Tensor, r: ScheduledRequest) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, then bad
    words (a word's last token where the output ends with the rest), on one [V] logits row in
    place, as vLLM defines them."""
    params = r.sampling_params
    history = r.history_token_ids
    if history is None:
        raise ValueError(f"request {r.request_id}: penalties need history_token_ids")
    # Only the tokens seen are touched: O(history), not O(vocabulary), per row.
    vocab = row.shape[0]
    num_prompt = len(history) - r.num_output_tokens
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in history if t < vocab}), dtype=torch.long,
                            device=row.device)
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) \
            and r.num_output_tokens > 0:
        output = torch.tensor(history[num_prompt:], dtype=torch.long, device=row.device)
        ids, counts = torch.unique(output, return_counts=True)
        row[ids] -= (params.frequency_penalty * counts.to(row.dtype)
                     + params.presence_penalty)
    if params.bad_words:
        if params.bad_words_token_ids is None:
            raise ValueError(f"request {r.request_id}: bad_words were never tokenized")
        output = history[num_prompt:]
        for word in params.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                row[word[-1]] = float("-inf")


def row_argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=-1)` for a 2-D float `x`, bit-equal (first index of the maximum; a NaN
    counts as the maximum), about 10x faster on CPU for vocabulary-wide rows: torch's CPU
    argmax is a scalar loop (2.7 ms for 64 x 49152 fp32 at one thread) while `amax` is
    vectorised. The block maxima locate the first block holding each row's maximum; the
    scalar argmax then runs over that block alone."""
    rows, cols = x.shape
    num_blocks = cols // _ARGMAX_BLOCK
    if x.device.type != "cpu" or num_blocks < 2 or rows < _ARGMAX_MIN_ROWS or not x.is_floating_point():
        return x.argmax(dim=-1)
    main = x[:, :num_blocks * _ARGMAX_BLOCK].view(rows, num_blocks, _ARGMAX_BLOCK)
    block_max = main.amax(dim=-1)  # [rows, blocks]
    if num_blocks * _ARGMAX_BLOCK < cols:  # a short last block
        block_max = torch.cat([block_max, x[:, num_blocks * _ARGMAX_BLOCK:].amax(dim=-1, keepdim=True)], 1)
    start = block_max.argmax(dim=-1) * _ARGMAX_BLOCK  # the first block holding the maximum
    # Columns past the end (short last block) repeat the last column: after it, never first.
    cols_idx = (start.unsqueeze(1) + torch.arange(_ARGMAX_BLOCK, device=x.device)).clamp_(max=cols - 1)
    return start + x.gather(1, cols_idx).argmax(dim=-1)


def sampling_probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """[N, V] the distribution a random row samples from: temperature, then min_p / top_k /
    top_p truncation (see `truncate_logits`), softmax."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = truncate_logits(logits / temps.unsqueeze(1), params)
    return torch.softmax(logits, dim=-1)


def truncate_logits(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Set to -inf every token that min_p, then top_k, then top_p (on what is left,
    renormalised) exclude, as vLLM orders them; `logits` [N, V] are temperature-scaled, one row
    per entry of `params`. Tokens tied with the last one kept by top-k or top-p are kept too,
    so the kept set never depends on how a sort orders equal values."""
    neg_inf = float("-inf")
    dev = logits.device
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, neg_inf)
    vocab = logits.shape[1]
    if any(p.top_k > 0 for p in params):
        ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        k_max = max(ks)
        kth = logits.topk(k_max, dim=-1).values.gather(
            1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev).unsqueeze(1))
        off = torch.tensor([k == 0 for k in ks], device=dev).unsqueeze(1)
        logits = logits.masked_fill((logits < kth) & ~off, neg_inf)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        probs = torch.softmax(sorted_logits, dim=-1)
        cumsum = probs.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cumsum[:, :1]), cumsum[:, :-1]], dim=1)
        num_kept = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)  # >= 1: before[0] = 0
        last_kept = sorted_logits.gather(1, num_kept - 1)
        off = (top_p >= 1.0).unsqueeze(1)
        logits = logits.masked_fill((logits < last_kept) & ~off, neg_inf)
    return logits
