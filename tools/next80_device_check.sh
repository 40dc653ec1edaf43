#!/usr/bin/env bash
# Qwen3-Next-80B-A3B's shape on the device (#15): the synthetic pack (about 45 GB, built on the CPUs
# while the kernels build), then `strata bench` resident and under budgets, then the chunked Gated
# DeltaNet kernels' bench. The pack wants the whole call: nothing else is built.
#
#   tools/next80_device_check.sh [steps...]     default: resident b12 b8
#     tests     the GPU tests in TESTS (default: the DeltaNet kernels, the tensor-core prompt attention
#               and the Qwen3-Next engine), run while the pack builds
#     resident  prompts 512,4096,16384, 64 decoded tokens after each, every weight in VRAM
#     residentcc  prompts 4096,16384 resident with --kernels-off tc-attention (the gated attention on
#               the CUDA-core kernel: the A/B of the head_dim-256 tensor-core prompt attention)
#     kvbench   tools/kv_attention_bench.py (device_deadline.sh kv_bench_ab: with KV_PARENT, the A/B
#               of an earlier cuda/kv_quant.cu), while the pack is still building if it is
#     b12, b8   the same at --vram-budget-gib 12 / 8 (experts cached and streamed)
#     gdn       tools/gdn_chunk_bench.py --sweep
# DEADLINE_S (default 570) bounds the whole run; logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPT_ARGS=("$@")
. tools/device_deadline.sh
device_setup next80-check resident b12 b8

start_pack qwen3-next-80b-a3b 300
during_pack() { has kvbench && kv_bench_ab; }
if has tests; then
    device_tests 300 20 ${TESTS:-tests/kernels/test_gated_delta_gpu.py tests/kernels/test_attention_tc_gpu.py \
        tests/engine/test_qwen3next_gpu.py}
else
    device_tests 300 3
fi
df -h /root 2>/dev/null | tail -1
export BENCH_LINES="^prompt|^decode|copy|^plan|^peak|stopped"
has resident && bench_synthetic next80_resident 120 qwen3-next-80b-a3b --prompt 512,4096,16384 --decode 64
has residentcc && bench_synthetic next80_residentcc 90 qwen3-next-80b-a3b --prompt 4096,16384 --decode 0 \
    --kernels-off tc-attention
for gib in 12 8; do
    has b$gib && bench_synthetic next80_b$gib 110 qwen3-next-80b-a3b --vram-budget-gib $gib --prompt 512,4096,16384 --decode 64
done
if has gdn; then
    echo "== gdn chunk bench ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/gdn_chunk_bench.py --sweep --json "$OUT/gdn_chunk.json" 2>&1 | tail -20
fi
echo "== done at $(elapsed) s"
