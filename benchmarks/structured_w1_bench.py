"""W1 with a JSON schema on every request against the same W1 unconstrained, one engine,
alternating every round: what structured outputs cost in batch throughput.

    .venv/bin/python benchmarks/structured_w1_bench.py --json benchmarks/results/structured_w1.json

W1: 64 prompts of 256 random tokens, 128 output tokens each, greedy, EOS ignored (so both
sides produce the same number of tokens; after a constrained output's JSON closes only stop
tokens are allowed, and those steps still mask). Schemas: a nested object with an array and
an enum (xgrammar) and a two-schema `allOf` (llguidance). Reported: output tok/s per round,
the median ratio to unconstrained, and how many output tokens were inside the JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_report import BenchReport  # noqa: E402

ITEM = {"type": "object", "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["a", "b", "c"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "kind", "tags"]}
SCHEMAS = {
    "xgrammar_nested": {"type": "object", "properties": {"items": {"type": "array", "items": ITEM}},
                        "required": ["items"]},
    "llguidance_allof": {"allOf": [ITEM, {"type": "object", "properties": {
        "note": {"type": "string"}}, "required": ["note"]}]},
}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:  # the JSON was still open at max_tokens
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from deepinfer import LLM, SamplingParams
    from deepinfer.structured.params import StructuredOutputsParams

    report = BenchReport()
    # no prefix caching: every case of a round sends the same prompts, and a cache would let
    # all but the first skip their prefill
    llm = LLM(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    vocab = tokenizer.vocab_size
    eos = {tokenizer.eos_token_id}

    def prompts(seed: int) -> list[dict]:
        r = random.Random(seed)
        return [{"prompt_token_ids": [r.randrange(200, vocab - 200) for _ in range(args.input_len)]}
                for _ in range(args.prompts)]

    def params(schema) -> SamplingParams:
        spec = None if schema is None else StructuredOutputsParams(json=schema)
        return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                              structured_outputs=spec)

    cases = {"unconstrained": None, **SCHEMAS}
    for name, schema in cases.items():  # warm-up, grammar compile included
        llm.generate(prompts(999)[:8], params(schema), use_tqdm=False)
    rates = {name: [] for name in cases}
    inside = {name: [] for name in SCHEMAS}
    complete = {name: [] for name in SCHEMAS}
    for rnd in range(args.rounds):
        batch = prompts(1000 + rnd)
        for name, schema in cases.items():
            start = time.perf_counter()
            outs = llm.generate(batch, params(schema), use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = [o.outputs[0].token_ids for o in outs]
            rates[name].append(sum(map(len, tokens)) / elapsed)
            if schema is not None:
                json_tokens = sum(len([t for t in ids if t not in eos]) for ids in tokens)
                inside[name].append(json_tokens / sum(map(len, tokens)))
                complete[name].append(sum(_parses(o.outputs[0].text) for o in outs) / len(outs))
            print(f"round {rnd} {name}: {rates[name][-1]:.1f} output tok/s", file=sys.stderr)
    median = {name: statistics.median(v) for name, v in rates.items()}
    result = {
        "workload": vars(args), "output_tok_s": rates, "median_output_tok_s": median,
        "ratio_to_unconstrained_median": {n: median[n] / median["unconstrained"] for n in SCHEMAS},
        "share_of_tokens_inside_json": {n: statistics.mean(v) for n, v in inside.items()},
        "share_of_outputs_closing_their_json": {n: statistics.mean(v) for n, v in complete.items()},
        "schemas": SCHEMAS}
    report.finish(result, args.json)
    print(json.dumps(result["ratio_to_unconstrained_median"], indent=2))


if __name__ == "__main__":
    main()
