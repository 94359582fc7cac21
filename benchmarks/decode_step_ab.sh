#!/bin/bash
# Decode-step times of two source trees of DeepInfer, alternating processes: a kernel change
# rebuilds the C libraries, so the two cannot share one process.
#   benchmarks/decode_step_ab.sh OLD_TREE NEW_TREE [ROUNDS]
# Each round runs benchmarks/perf_step_profile.py (the runner alone, synthetic decode steps
# after 300 tokens of context) in OLD_TREE, then in NEW_TREE. Run nothing else meanwhile.
set -eu
OLD=$(cd "${1:?usage: decode_step_ab.sh OLD_TREE NEW_TREE [ROUNDS]}" && pwd)
NEW=$(cd "${2:?usage: decode_step_ab.sh OLD_TREE NEW_TREE [ROUNDS]}" && pwd)
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
CASES=${CASES:-decode_b1_ctx300,decode_b4_ctx300}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "${3:-3}"); do
  for tree in "$OLD" "$NEW"; do
    (cd "$tree" && PYTHONPATH="$tree" "$PY" "$NEW/benchmarks/perf_step_profile.py" \
       --cases "$CASES" --repeats 30 --rounds 1 2>/dev/null | grep "wall median" \
       | sed "s#^#round $r $(basename "$tree") #")
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
