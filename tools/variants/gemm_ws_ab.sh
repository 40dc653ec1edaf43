#!/usr/bin/env bash
# #17: builds of cuda/moe_gemm_ws.cu (and this tree's moe_gemm.cu) against the parent commit's moe_gemm.cu,
# from fatbins and without a package build: each arm's checks in a process of its own (bit-equality to the
# parent's outputs printed where it is not 100%), then the arms that passed timed together on the 30B's
# prompt shapes (tools/moe_gemm_ab.py). Build the fatbins here first (nvcc, a minute):
#   parent:  git archive <parent> cuda | tar -x -C /tmp/parent && nvcc -fatbin -O3 -std=c++17 -arch=sm_90
#            -I/tmp/parent/cuda -o .whl/moe_gemm_parent.fatbin /tmp/parent/cuda/moe_gemm.cu
#   arms:    bash tools/variants/make_wgmma.sh (mma, ws: the default build, whose ws16 entry points take X
#            as f16; and the trial builds ws1, wsp, ws_s6, ws_n256: -D... as the table below says; and dequant.fatbin)
# Then on the GPU machine, .whl carried: OUT=... bash tools/variants/gemm_ws_ab.sh [arm ...]
W=.whl
OUT=${OUT:-/tmp}
declare -A A=(
 [mma]="mma:$W/moe_gemm_mma.fatbin:strata_moe_gemm"
 [ws]="ws:$W/moe_gemm_ws.fatbin:strata_moe_gemm_ws:ws"                                  # two producer warpgroups
 [ws16]="ws16:$W/moe_gemm_ws.fatbin:strata_moe_gemm_ws16:ws16"                          # the same, X as f16
 [ws1]="ws1:$W/moe_gemm_ws1.fatbin:strata_moe_gemm_ws:ws:384"                           # -DSTRATA_WS_GEMM_PRODUCERS=1
 [wsp]="wsp:$W/moe_gemm_wsp.fatbin:strata_moe_gemm_ws:ws"                               # -DSTRATA_WS_GEMM_PREFETCH
 [ws16p]="ws16p:$W/moe_gemm_wsp.fatbin:strata_moe_gemm_ws16:ws16"                       # the same, X as f16
 [ws16s6]="ws16s6:$W/moe_gemm_ws_s6.fatbin:strata_moe_gemm_ws16:ws16:512:196704"        # -DSTRATA_WS_GEMM_STAGES=6
 [wsn256]="wsn256:$W/moe_gemm_ws_n256.fatbin:strata_moe_gemm_ws:ws:384:196672"          # -DSTRATA_WS_GEMM_BN=256, 1 producer WG
 [ws16n256]="ws16n256:$W/moe_gemm_ws_n256.fatbin:strata_moe_gemm_ws16:ws16:384:196672"  # the same, X as f16
 [wst]="wst:$W/moe_gemm_ws.fatbin:strata_moe_gemm_wst:wst"                              # the TMA build (F16 shapes only)
 [wst256]="wst256:$W/moe_gemm_ws_n256.fatbin:strata_moe_gemm_wst:wst:384:197696"       # the same, 256-row items
 [wsts6]="wsts6:$W/moe_gemm_ws_s6.fatbin:strata_moe_gemm_wst:wst:512:197728")            # the same, six stages
REF="parent:$W/moe_gemm_parent.fatbin:strata_moe_gemm"
arms=("$@"); [ ${#arms[@]} -eq 0 ] && arms=(mma ws ws16 ws16n256 wst wst256 wsts6 ws1 wsp ws16p ws16s6 wsn256)
pass=()
for n in "${arms[@]}"; do
    [ -f "$(echo "${A[$n]}" | cut -d: -f2)" ] || { echo "== $n: no fatbin"; continue; }
    echo "== checks $n"
    if timeout 120 python3 tools/moe_gemm_ab.py --arm "$REF" --arm "${A[$n]}" --no-times --json "$OUT/check_$n.json" \
            > "$OUT/check_$n.log" 2>&1; then
        pass+=(--arm "${A[$n]}"); echo passed
    else
        grep -v " ok " "$OUT/check_$n.log" | tail -5
    fi
    grep "equal to parent" "$OUT/check_$n.log" | grep -v "100.0%" | grep -v "^ *parent" | head -3
done
echo "== times"
# each shape again with f16 weights (dequantized once: the ws16 arms copy both operands by cp.async), and the
# price of that dequantization (cuda/dequant.cu's strata_dequant_h_<type>, checked against f16(dequantize))
dq=(); [ -f $W/dequant.fatbin ] && dq=(--retype F16 --dequant $W/dequant.fatbin)
timeout 300 python3 tools/moe_gemm_ab.py --arm "$REF" "${pass[@]}" "${dq[@]}" --json "$OUT/times.json" 2>&1 | grep -v " ok " | tail -44
