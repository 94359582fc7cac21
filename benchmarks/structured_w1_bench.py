"""W1 with a JSON schema on every request against the same W1 unconstrained, one engine,
alternating every round: what structured outputs cost in batch throughput.

    .venv/bin/python benchmarks/structured_w1_bench.py --json benchmarks/results/structured_w1.json

W1: 64 prompts of 256 random tokens, 128 output tokens each, greedy, EOS ignored (so both
sides produce the same number of tokens; after a constrained output's JSON closes only stop
tokens are allowed, and those steps still mask). Schemas: a nested object with an array and
an enum (xgrammar) and a two-schema `allOf` (llguidance). Reported: output tok/s per round,
the median ratio to unconstrained, and how many output tokens were inside the JSON.

`--engine vllm --model <HF dir>` runs the same workload on vLLM CPU (run it with the peer's
python, ../shared/peers/); `--vs-vllm <vLLM python> --vllm-model <HF dir>` alternates the two
engines, one process per engine per round (model loading and grammar compiles outside the
timed part), and reports DeepInfer's constrained throughput against vLLM's with the same
schemas:

    .venv/bin/python benchmarks/structured_w1_bench.py --vs-vllm /work/peers/vllm/bin/python \
        --vllm-model /work/peers/models/hf --rounds 2 --json benchmarks/results/structured_vs_vllm.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
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


def _engine(args):
    """(llm, SamplingParams factory for a schema or None) of the chosen engine."""
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        try:  # vLLM >= 0.10.2 names it structured_outputs, before guided_decoding
            from vllm.sampling_params import StructuredOutputsParams as Spec
            field = "structured_outputs"
        except ImportError:
            from vllm.sampling_params import GuidedDecodingParams as Spec
            field = "guided_decoding"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
        # on CPU this fraction of the machine's memory is reserved at start, and the box is
        # shared with the DeepInfer run: a quarter holds the 4 GiB cache and the model
        llm = LLM(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False,
                  max_model_len=1024, gpu_memory_utilization=0.25)
    else:
        from deepinfer import LLM, SamplingParams
        from deepinfer.structured.params import StructuredOutputsParams as Spec
        field = "structured_outputs"
        # no prefix caching: every case of a round sends the same prompts, and a cache would
        # let all but the first skip their prefill
        llm = LLM(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False)

    def params(schema):
        spec = {} if schema is None else {field: Spec(json=schema)}
        return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, **spec)
    return llm, params


def _alternate(args) -> None:
    """Rounds of (DeepInfer, vLLM) child runs, the order flipped every round."""
    runs = {"deepinfer": [], "vllm": []}
    common = ["--prompts", str(args.prompts), "--input-len", str(args.input_len),
              "--output-len", str(args.output_len), "--rounds", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = ["deepinfer", "vllm"] if rnd % 2 == 0 else ["vllm", "deepinfer"]
            for engine in order:
                out = os.path.join(tmp, f"{engine}-{rnd}.json")
                python = sys.executable if engine == "deepinfer" else args.vs_vllm
                model = ["--model", args.model] if engine == "deepinfer" and args.model else []
                if engine == "vllm":
                    model = ["--model", args.vllm_model]
                cmd = [python, os.path.abspath(__file__), "--engine", engine, *model, *common,
                       "--seed-offset", str(rnd), "--json", out]
                env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
                subprocess.run(cmd, check=True, env=env)
                with open(out) as f:
                    runs[engine].append(json.load(f))
                print(f"round {rnd} {engine}: {runs[engine][-1]['median_output_tok_s']}",
                      file=sys.stderr)
    cases = ["unconstrained", *SCHEMAS]
    med = {e: {c: statistics.median(r["median_output_tok_s"][c] for r in rs) for c in cases}
           for e, rs in runs.items()}
    result = {"workload": vars(args), "median_output_tok_s": med,
              "deepinfer_over_vllm": {c: med["deepinfer"][c] / med["vllm"][c] for c in cases},
              "ratio_to_unconstrained": {e: {c: med[e][c] / med[e]["unconstrained"]
                                             for c in SCHEMAS} for e in med},
              "rounds": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("deepinfer_over_vllm", "ratio_to_unconstrained")},
                     indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--engine", choices=("deepinfer", "vllm"), default="deepinfer")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed-offset", type=int, default=0, help="prompt seeds of the rounds")
    p.add_argument("--vs-vllm", default=None, metavar="PYTHON",
                   help="alternate with vLLM CPU run by this python (a venv with vllm-cpu)")
    p.add_argument("--vllm-model", default=None, help="HF checkpoint dir for vLLM")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.vs_vllm:
        if not args.vllm_model:
            p.error("--vs-vllm needs --vllm-model")
        return _alternate(args)
    if args.engine == "vllm" and not args.model:
        p.error("--engine vllm needs --model (a Hugging Face checkpoint directory)")

    report = BenchReport() if args.engine == "deepinfer" else None
    llm, params = _engine(args)
    tokenizer = llm.get_tokenizer()
    vocab = tokenizer.vocab_size
    eos = {tokenizer.eos_token_id}

    def prompts(seed: int) -> list[dict]:
        r = random.Random(seed)
        return [{"prompt_token_ids": [r.randrange(200, vocab - 200) for _ in range(args.input_len)]}
                for _ in range(args.prompts)]

    cases = {"unconstrained": None, **SCHEMAS}
    for name, schema in cases.items():  # warm-up, grammar compile included
        llm.generate(prompts(999)[:8], params(schema), use_tqdm=False)
    rates = {name: [] for name in cases}
    inside = {name: [] for name in SCHEMAS}
    complete = {name: [] for name in SCHEMAS}
    for rnd in range(args.rounds):
        batch = prompts(1000 + args.seed_offset + rnd)
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
    if report is not None:
        report.finish(result, args.json)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result["ratio_to_unconstrained_median"], indent=2))


if __name__ == "__main__":
    main()
