"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Random rows sample by the exponential race (argmax of p / E with E ~ Exp(1)), which equals
multinomial sampling and lets a seeded request draw its noise from its own generator, so its
output does not depend on what else is in the batch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest, TokenLogprobs


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def sample(self, logits: Tensor, requests: list[ScheduledRequest]
               ) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """logits [N, V] float32, one row per request in `requests`."""
        self._mask_min_tokens(logits, requests)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        rand = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if len(greedy) == len(requests):
            tokens = logits.argmax(dim=-1)  # all greedy: no row gather (a full logits copy)
        elif greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            tokens[idx] = self._sample_random(logits[idx], [requests[i] for i in rand])
        token_list = tokens.tolist()
        logprobs = self._logprobs(logits, requests, token_list)
        return token_list, logprobs

    @staticmethod
    def _mask_min_tokens(logits: Tensor, requests: list[ScheduledRequest]) -> None:
        for i, r in enumerate(requests):
            params = r.sampling_params
            if r.num_output_tokens < params.min_tokens:
                banned = list(r.eos_token_ids) + list(params.stop_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def _sample_random(self, logits: Tensor, requests: list[ScheduledRequest]) -> Tensor:
        temps = torch.tensor([r.sampling_params.temperature for r in requests],
                             dtype=logits.dtype, device=logits.device)
        logits = logits / temps.unsqueeze(1)
        logits = _apply_top_k_top_p_min_p(logits, requests)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for i, r in enumerate(requests):
            if r.sampling_params.seed is None:
                unseeded.append(i)
            else:
                noise[i].exponential_(generator=self._generator_for(r))
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device
                                     ).exponential_(generator=self.default_generator)
        return (probs / noise).argmax(dim=-1)

    def _generator_for(self, r: ScheduledRequest) -> torch.Generator:
        gen = self._generators.get(r.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(r.sampling_params.seed)
            self._generators[r.request_id] = gen
        return gen

    @staticmethod
    def _logprobs(logits: Tensor, requests: list[ScheduledRequest], tokens: list[int]
                  ) -> dict[str, TokenLogprobs]:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return {}
        idx = torch.tensor(rows, device=logits.device)
        logp = torch.log_softmax(logits[idx], dim=-1)
        k_max = max(requests[i].sampling_params.logprobs for i in rows)
        top_vals, top_ids = logp.topk(max(k_max, 1), dim=-1)
        out = {}
        for j, i in enumerate(rows):
            k = requests[i].sampling_params.logprobs
            token_lp = logp[j, tokens[i]]
            out[requests[i].request_id] = TokenLogprobs(
                token_id=tokens[i], logprob=float(token_lp),
                rank=int((logp[j] > token_lp).sum()) + 1,
                top_token_ids=top_ids[j, :k].tolist(), top_logprobs=top_vals[j, :k].tolist())
        return out


def _apply_top_k_top_p_min_p(logits: Tensor, requests: list[ScheduledRequest]) -> Tensor:
    params = [r.sampling_params for r in requests]
    use_k = any(p.top_k > 0 for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    if use_min_p:
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        drop |= ranks >= k.unsqueeze(1)
    if use_p:
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop |= before >= top_p.unsqueeze(1)  # the top token always stays (before == 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
