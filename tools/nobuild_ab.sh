#!/usr/bin/env bash
# A session's first device call when kernel variants wait to be decided: no package build. The fatbins
# come from tools/variants/make_wgmma.sh and tools/variants/make_gemv_parent.sh, run here first where
# nvcc is on PATH (a minute; so they are this tree's), else taken from a carried .whl.
#   1. the wgmma prompt GEMM (#17) against mma.sync: each wgmma arm checked in a process of its own (a
#      faulting arm poisons only its own CUDA context), then the arms that passed timed together;
#   2. the wgmma prompt attention (#17, #14) against attention_tc.cu, the same way;
#   3. the decode GEMVs (#16, #19) of this tree against an earlier commit's (GEMV_PARENT, default HEAD^).
# JSON reports under $OUT (default /tmp). About 3-5 minutes.
#
#   tools/nobuild_ab.sh [gemm] [attention] [gemv]      default: all three
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
mkdir -p "$OUT"       # the tools write their JSON there: a missing folder failed every arm after its checks
W=.whl
PY=${PY:-python3}
want() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
STEPS=("$@"); [ ${#STEPS[@]} -eq 0 ] && STEPS=(gemm attention gemv)

if command -v nvcc > /dev/null && [ -z "${KEEP_FATBINS:-}" ]; then
    echo "== building the variants' fatbins from this tree"
    { want gemm || want attention; } && bash tools/variants/make_wgmma.sh 2>&1 | tail -1
    want gemv && bash tools/variants/make_gemv_parent.sh "${GEMV_PARENT:-HEAD^}" 2>&1 | tail -1
fi

decide() {      # decide TOOL REF_ARM NOTIME_FLAG ARM...: check each arm beside REF_ARM alone, time those that pass
    local tool=$1 ref=$2 notime=$3; shift 3
    local passed=("$ref") arm name
    for arm in "$@"; do
        name=${arm%%:*}
        echo "== $tool: checks of $name"
        if timeout 240 $PY "tools/$tool.py" --arm "$ref" --arm "$arm" $notime --json "$OUT/${tool}_$name.json" 2>&1 \
                | tail -25; [ "${PIPESTATUS[0]}" -eq 0 ]; then
            passed+=("$arm")
        fi
    done
    echo "== $tool: times of ${passed[*]%%:*}"
    local args=(); for arm in "${passed[@]}"; do args+=(--arm "$arm"); done
    timeout 300 $PY "tools/$tool.py" "${args[@]}" --json "$OUT/${tool}_times.json" 2>&1 | tail -14
}

if want gemm; then
    decide moe_gemm_ab "mma:$W/moe_gemm_mma.fatbin:strata_moe_gemm" --no-times \
        "ws:$W/moe_gemm_ws.fatbin:strata_moe_gemm_ws:ws" \
        ${WS_ARMS:-}
fi
if want attention; then
    decide attention_wg_ab "tc:$W/attention_tc.fatbin:strata_attention_prefill_tc_f16" --chunks= \
        "wg:$W/attention_wg.fatbin:strata_attention_prefill_wg_f16" \
        "ws:$W/attention_ws.fatbin:strata_attention_prefill_ws128_f16:128:384:163968" \
        "ws64:$W/attention_ws.fatbin:strata_attention_prefill_ws64_f16:128:384:163968" \
        "wst:$W/attention_ws.fatbin:strata_attention_prefill_wst128_f16:128:384:164928:tma" \
        "wst64:$W/attention_ws.fatbin:strata_attention_prefill_wst64_f16:128:384:197696:tma64"
fi
if want gemv; then
    echo "== gemv_rows_ab: parent against tree"
    timeout 200 $PY tools/gemv_rows_ab.py --arm "parent:$W/gemv_parent.fatbin:$W/decode_fused_parent.fatbin" \
        --arm "tree:$W/gemv_tree.fatbin:$W/decode_fused_tree.fatbin" --json "$OUT/gemv_rows_ab.json" 2>&1 | tail -30
fi
echo "== done"
