#!/bin/bash
# DeepInfer against llama.cpp on the same quantized GGUF files, one run, engines alternating:
# the shipped SmolLM2-135M-Instruct Q4_1 file and a Q8_0 file written by llama.cpp's converter.
#   PEER_WORK=<the setup.sh directory> benchmarks/quant_vs_llamacpp.sh OUT_DIR
# Per file: DeepInfer through its vLLM-shaped LLM (../shared/peers/bench_offline.py: W1 = 64 x
# 256-token prompts, 128 output tokens, greedy, EOS ignored; batch-1 decode of 256 tokens after
# a 512-token prompt), llama-bench pp512 / tg128 and llama-server under the same W1
# (run_server_one.sh), and llama-bench tg256 at depth 512. Run nothing else meanwhile. FORMATS="q4_1" runs one file.
set -eu
W="${PEER_WORK:?set PEER_WORK to the directory of ../shared/peers/setup.sh}"
OUT=${1:?usage: quant_vs_llamacpp.sh OUT_DIR}; mkdir -p "$OUT"
P=$(cd "$(dirname "$0")/.." && pwd); H=$(cd "$P/../shared/peers" 2>/dev/null && pwd || echo /work/shared/peers)
export HF_HUB_OFFLINE=1 REPS=${REPS:-2}
Q4=$W/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
Q8=$W/models/gguf/SmolLM2-135M-Instruct-q8_0.gguf
FORMATS=${FORMATS:-q4_1 q8_0}
if [ ! -f "$Q8" ] && [[ " $FORMATS " == *" q8_0 "* ]]; then
  "$W/venv-ref/bin/python" "$(ls -d "$W"/llamacpp/llama_cpp_python-*/vendor/llama.cpp)/convert_hf_to_gguf.py" \
    "$W/models/hf" --outtype q8_0 --outfile "$Q8" > /dev/null
fi
di() {  # file tag
  PEER_MODEL_DIR=$1 ENGINE=deepinfer "$P/.venv/bin/python" "$H/bench_offline.py" bfloat16 > "$OUT/deepinfer_$2.log" 2>&1
  grep SUMMARY "$OUT/deepinfer_$2.log" | sed "s/^/deepinfer[$2] /"
}
lc() {
  PORT=18181 bash "$H/run_server_one.sh" "$1" 64 1 > "$OUT/llamacpp_server_$2.log" 2>&1
  tail -1 "$OUT/llamacpp_server_$2.log" | sed "s/^/llama-server[$2] /"
}
lb() {
  # pp512 / tg128 from an empty cache, and tg256 after 512 tokens of context (the depth
  # DeepInfer's batch-1 figure decodes at)
  "$W/llamacpp/bin/llama-bench" -m "$1" -t "$(nproc)" -p 512 -n 128 -r 3 -o json > "$OUT/llamabench_$2.json" 2>/dev/null
  "$W/llamacpp/bin/llama-bench" -m "$1" -t "$(nproc)" -p 0 -n 256 -d 512 -r 3 -o json > "$OUT/llamabench_d512_$2.json" 2>/dev/null
  python3 -c "import json;d=json.load(open('$OUT/llamabench_$2.json'))+json.load(open('$OUT/llamabench_d512_$2.json'));print('llama-bench[$2]', ' '.join(f\"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']}{'@d'+str(r['n_depth']) if r.get('n_depth') else ''}={r['avg_ts']:.1f}tok/s\" for r in d))"
}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for f in $FORMATS; do
  file=$Q4; [ $f = q8_0 ] && file=$Q8
  di "$file" $f; lb "$file" $f; lc "$file" $f
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
