#!/usr/bin/env bash
# The decode-graph work in one device call, inside a deadline: build + GPU tests (tools/device_check.sh)
# while the synthetic pack is built on the CPUs beside them, then the decode A/B on one load
# (tools/decode_graph_ab.py: eager vs graph, host ms per token, bitwise), then the bench with
# STRATA_CUDA_GRAPHS=1 and =0 as far as the time allows. Tables last; logs under $OUT.
#
#   tools/decode_graph_check.sh [SHAPE] [pytest paths...]    default: qwen3-30b-a3b; the graph and runner
#                                                            tests first, then tests/kernels
# DEADLINE_S (default 265) bounds the whole run; each step gets what is left, capped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/strata-graph-check}
mkdir -p "$OUT"
SHAPE=${1:-qwen3-30b-a3b}
shift || true
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/kernels/test_graphs_gpu.py tests/engine/test_cuda_runner.py tests/kernels)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-265}
. tools/device_deadline.sh
start_pack "$SHAPE" 240

OUT=/tmp/strata-check timeout "$(budget 150)" tools/device_check.sh "${tests[@]}" >"$OUT/check.log" 2>&1
echo "== build + tests rc=$? at $(elapsed) s"
cp /tmp/strata-check/pytest.log "$OUT/pytest.log" 2>/dev/null
grep -E "^(FAILED|ERROR)" /tmp/strata-check/pytest.log | head -20
sed -n '/^== summary/,$p' "$OUT/check.log"

wait $pack_pid
cat "$OUT/pack.log"
export PYTHONPATH=$PWD:/tmp/strata-site${PYTHONPATH:+:$PYTHONPATH}
left=$(budget 70)
if [ "$left" -gt 20 ]; then
    timeout "$left" $PY tools/decode_graph_ab.py --synthetic "$SHAPE" --contexts 512,4096 --decode 64 \
        --json "$OUT/ab.json" >"$OUT/ab.log" 2>&1
    echo "== decode A/B rc=$? at $(elapsed) s"
    grep -v -E "^(ab:|strata: uploading)" "$OUT/ab.log" | tail -12
fi
for graphs in 1 0; do
    left=$(budget 60)
    [ "$left" -gt 20 ] || { echo "== bench STRATA_CUDA_GRAPHS=$graphs: no time left"; continue; }
    STRATA_CUDA_GRAPHS=$graphs timeout "$left" $PY -m strata bench --synthetic "$SHAPE" --device cuda \
        --prompt 512,4096 --decode 64 >"$OUT/bench_graphs$graphs.log" 2>&1
    echo "== bench STRATA_CUDA_GRAPHS=$graphs rc=$? at $(elapsed) s"
    grep -v -E "^(bench:|strata: uploading)" "$OUT/bench_graphs$graphs.log" | tail -12
done
