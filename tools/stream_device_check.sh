#!/usr/bin/env bash
# Expert streaming and the fused/tensor-core paths in one device call, inside a deadline: the
# synthetic pack is built on the CPUs while tools/device_check.sh builds and runs the GPU tests, then
# the bit-identical check (tools/stream_check.py) and the benches, resident and under budgets.
#
#   tools/stream_device_check.sh [steps...]      default: tests identical resident b12 b8 nocache
#     tests      build + GPU tests (TESTS overrides the pytest paths)
#     identical  tools/stream_check.py --budget-gib 8 (4096-token prompt, 64 decoded tokens)
#     resident   bench, every expert in VRAM: --prompt 4096,16384 --decode 64
#     b12 / b8   bench at --vram-budget-gib 12 / 8: --prompt 16384 (b8: 4096) --decode 64
#     nocache    bench with no expert cached (--expert-cache 0): --prompt 16384
#     r16k       bench, every expert in VRAM: --prompt 16384 only (nocache's reference in the same call)
#     ab         seed 000's A/B at 8 GiB: --prefill-rule bytes against slots, prompts 4096 and 16384
#     abbytes    the byte-budget half of ab only
#     lfu        bench at 8 GiB with --expert-policy lfu (against b8's lru)
#     profile    tools/decode_profile.py --graphs-only: each kernel's time in the step's graph, contexts 512 and 4096
#     dvariants  tools/decode_variants.py: resident decode, PDL on/off and the other decode variants
#     pvariants  tools/prompt_variants.py: resident prompts, routing grouped on the device vs the host
#     partpin    bench at 12 GiB with --pin-limit-gib 8 (the unpinned share staged by helper threads)
# DEADLINE_S (default 570) bounds the whole run; logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPT_ARGS=("$@")
. tools/device_deadline.sh
device_setup stream-check tests identical resident b12 b8 nocache

start_pack qwen3-30b-a3b 200

if has tests; then
    device_tests 300 45 ${TESTS:-tests/kernels/test_decode_fused_gpu.py tests/kernels/test_moe_decode_gpu.py tests/kernels/test_moe_gemm_gpu.py tests/kernels/test_attention_tc_gpu.py tests/kernels/test_graphs_gpu.py tests/engine/test_cuda_runner.py}
else
    device_tests 120 3
fi

bench() {  # bench NAME SECONDS ARGS...: on qwen3-30b-a3b
    local name=$1 secs=$2; shift 2
    bench_synthetic "$name" "$secs" qwen3-30b-a3b "$@"
}
if has identical; then
    echo "== identical ($(elapsed) s)"
    timeout "$(budget 150)" $PY tools/stream_check.py --budget-gib 8 --json "$OUT/identical.json" 2>"$OUT/identical.err" \
        | tee "$OUT/identical.log"
    [ "${PIPESTATUS[0]}" -gt 1 ] && tail -8 "$OUT/identical.err"
fi
has resident && bench resident 100 --prompt 512,4096,16384 --decode 64
has b12 && bench b12 80 --vram-budget-gib 12 --prompt 512,16384 --decode 64
has b8 && bench b8 80 --vram-budget-gib 8 --prompt 512,4096 --decode 64
has r16k && bench r16k 60 --prompt 16384 --decode 0
has nocache && bench nocache 60 --vram-budget-gib 12 --expert-cache 0 --prompt 16384 --decode 0
if has ab; then
    bench ab_bytes 80 --vram-budget-gib 8 --prefill-rule bytes --prompt 4096,16384 --decode 0
    bench ab_slots 80 --vram-budget-gib 8 --prefill-rule slots --prompt 4096,16384 --decode 0
fi
if has dvariants; then
    echo "== decode variants ($(elapsed) s)"
    timeout "$(budget 150)" $PY tools/decode_variants.py --context 512 --decode 64 ${DVARIANTS_ARGS:-} \
        2>"$OUT/dvariants.err" | tee "$OUT/dvariants.log"
    [ "${PIPESTATUS[0]}" -ne 0 ] && tail -5 "$OUT/dvariants.err"
fi
if has pvariants; then
    echo "== prompt variants ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/prompt_variants.py 2>"$OUT/pvariants.err" | tee "$OUT/pvariants.log"
    [ "${PIPESTATUS[0]}" -ne 0 ] && tail -5 "$OUT/pvariants.err"
fi
has abbytes && bench ab_bytes 80 --vram-budget-gib 8 --prefill-rule bytes --prompt 4096,16384 --decode 0
has partpin && bench partpin 90 --vram-budget-gib 12 --pin-limit-gib 8 --prompt 4096 --decode 32
has lfu && bench lfu 60 --vram-budget-gib 8 --expert-policy lfu --prompt 512 --decode 64
if has profile; then
    echo "== decode profile ($(elapsed) s)"
    for ctx in ${PROFILE_CONTEXTS:-512 4096}; do
        timeout "$(budget 90)" $PY tools/decode_profile.py --graphs-only --context $ctx --json "$OUT/profile$ctx.json" \
            2>"$OUT/profile$ctx.err" | head -30 | tee "$OUT/profile$ctx.log"
    done
fi
echo "== done at $(elapsed) s"
