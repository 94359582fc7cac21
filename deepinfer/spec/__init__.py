"""Speculative decoding: drafters propose tokens, the target verifies them in one forward.

    spec_config.py       SpeculativeConfig (vLLM's --speculative-config), pure
    drafter.py           the Drafter interface and the DraftRequest it reads, pure
    ngram.py             prompt lookup: no weights, an n-gram index per request, pure
    draft_model.py       a smaller model with the same tokenizer and its own paged KV cache
    mtp_drafter.py       DeepSeek-V3's multi-token-prediction layers fed the target's hidden states
    draft_runner.py      runs a drafter model over synthetic scheduled requests
    rejection_sampler.py accept/reject drafts against the target's distribution
    verifier.py          the runner's sampling step when some requests verify drafts
    speculator.py        builds the pieces and proposes drafts after every engine step

Importing this package loads no torch (the config and the n-gram drafter are pure).
"""
