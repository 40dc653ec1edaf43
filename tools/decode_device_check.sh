#!/usr/bin/env bash
# Decode at the copy rate (#16) and prompt GEMMs (#17): the GPU tests of the decode kernels, then
# on qwen3-30b-a3b the variants (one load, kernel paths toggled) and benches.
#
#   tools/decode_device_check.sh [steps...]     default: tests variants bench
#     tests     build + the decode kernels' GPU tests (TESTS overrides the list)
#     variants  tools/decode_variants.py at contexts 512 and 16384 (PDL, split GEMV, fused MoE grids)
#     bench     `strata bench` resident, prompt 512,16384 and 64 decoded tokens (timed after 2 untimed steps, whose time
#               bench prints apart); bench prints the copy rate
#     budget    the same at 12 and 8 GiB (--vram-budget-gib), prompt 512
#     profile   tools/decode_profile.py --graphs-only at context 512
#     rows      tools/decode_profile.py's eager kernel table for 1 and for 4 rows (--rows: four parallel slots'
#               batched step, each slot at context 192), to say which kernels grow with the rows (#19, #16)
#     ncu       Nsight Compute over tools/moe_decode_bench.py (Q4_K, 1 and 4 tokens, the graph's kernel
#               nodes one by one): speed of light, memory workload, warp stalls and occupancy of the MoE
#               decode kernels (#16's next look); the report in $OUT/ncu.csv, the key rows printed
#     moeab     device_deadline.sh's moe_decode_ab: the MoE decode kernels of each .cu in MOE_VARIANTS
#               (cuda/moe_decode.cu itself among them for the A/B), speed, registers and output digests
#     gemvab    the row-invariant batched GEMVs (gemv.cu, decode_fused.cu) against GEMV_ARMS' fatbins: each arm
#               "name:gemv.fatbin:decode_fused.fatbin[:moe_decode.fatbin]" (- keeps this build's), then this build: decode_profile
#               --rows 4 and tools/parallel_bench.py resident at 1 and 4 clients in each (#19, #16); with
#               GEMV_ARM_TESTS=1, test_row_invariant_gpu's GEMV tests first in each arm
#               (tools/variants/make_gemv_parent.sh builds a parent commit's arm; PAR_CONTEXT: the slots' context)
#     cluster   the f16 decode attention of short rows in one cluster launch (cuda/attention.cu strata_attention_decode_cl_*,
#               --kernels-on cluster-decode): kv_attention_bench f16 against f16cl at CLUSTER_CELLS (256 to 2048), the
#               split-K's splits sized for a 40,960-cell cache as the engine's are; decode_variants --cluster at 512
#               (A B A B on one load); resident bench after 512 on, then off
#     routeab   the router's top-k in its last block (--kernels-on fused-route) against its own launch:
#               tools/decode_variants.py --route (A B A B on one load, context 512), then tools/parallel_bench.py
#               resident at 1 and 4 clients with and without (STRATA_KERNELS_ON=fused-route)
#     inmoe     the top-k in the MoE gate|up kernel's blocks (route-in-moe) and the post-attention norm in the
#               router's (norm-in-router), both on by default: tools/decode_variants.py --route-in-moe (both, each,
#               neither, twice on one load, context 512), decode_profile --graphs-only at context 512 with both and
#               --kernels-off of both, 12 GiB decode (prompt 512, INMOE_DECODE tokens) on, off, on, off (INMOE_B12_ROUNDS=1:
#               on, off), then resident prompts INMOE_RES_PROMPTS (512,16384) with decode after each, on and off
#     ctx16     decode after CTX16_CONTEXT (16384) cells: decode_profile --graphs-only there, then resident bench (prompt
#               16384, 128 decoded) with the defaults, --kernels-off route-in-moe,norm-in-router, the attention
#               combine before fc452d8 (.whl/attention_precombine.fatbin from tools/variants/make_combine_arms.sh,
#               if carried), the defaults again
#     combine   the decode combine: the tree's (splits up to the last used one, a chunk's loads ahead of its FMAs),
#               before fc452d8 (every split), acfcca8's (a list of the used splits) and fb542fb's (one load a split),
#               fatbins from tools/variants/make_combine_arms.sh carried in .whl: on each, test_attention_gpu -k
#               combine and test_kv_decode_digest_gpu (the stored digests: the same bits as the tree's);
#               tools/decode_variants.py --fatbin-arms at COMBINE_CONTEXTS (16384 512); kv_attention_bench f16,f16tc
#               at 512,16384 cells on each; decode_profile at 16384
#     routerab  tools/router_bench.py (48 routers from a graph, fused and apart, 1 and 4 tokens) on each arm of
#               ROUTER_ARMS ("name:gemv.fatbin:moe_route.fatbin[:router grid]", - keeps this build's), then on this build
#     partrace  tools/parallel_bench.py --trace at PARTRACE_GIB (default 12) GiB, clients PARTRACE_CLIENTS (1,2,4),
#               context 1024, no long round: where each scheduler iteration's time goes (#19); PARTRACE_EMPTY="tree 16"
#               runs it again with the admissions into empty slots capped at 16 a step (the A/B of that cap)
#     parfull   tools/parallel_bench.py resident at 1, 2, 4 and 8 clients with its 16K long-prompt round (#19's table)
#     fit       tools/moe_decode_bench.py at one token, --A 1, 2, 4 and 8 (Q4_K, FIT_TYPES overrides), then
#               tools/moe_decode_fit.py: each MoE decode kernel's time as a fixed cost plus bytes over a rate
#     ttft      device_deadline.sh's ttft_serve on qwen3-30b-a3b: a short chat turn's first token at 8 GiB
#     gemm      tools/moe_gemm_bench.py (the grouped tensor-core GEMM per production shape), then resident
#               prompts 512,4096,16384
#     wgprompt  #17's prompt kernels on wgmma (cuda/moe_gemm_ws.cu, cuda/attention_wg.cu; on trial:
#               --kernels-on wgmma-gemm,wgmma-attention) against mma.sync in one lease: test_moe_gemm_gpu and
#               test_attention_tc_gpu over both builds, moe_gemm_bench per library, resident prompts
#               512,4096,16384 with neither, both and each, then 16384 at 12 GiB with neither and both
#     gemmab    tools/variants/gemm_ws_ab.sh on the carried fatbins while the pack is made (GEMMAB_ARMS: its arms)
#     wsgemm    #17: the prompt GEMMs warp-specialized on wgmma (cuda/moe_gemm_ws.cu, --kernels-on wgmma-gemm) against
#               moe_gemm.cu: test_moe_gemm_gpu over both (and test_dequant_gpu's f16 tests; WSGEMM_TEST_K: -k), moe_gemm_bench per
#               WSGEMM_OPS (default "moe_gemm moe_gemm_ws"; OP:--f16 times the shapes as F16; moe_gemm_wst the TMA build;
#               WSGEMM_N256=1: the TMA build again as the 256-row trial fatbin), resident prompts WSGEMM_PROMPTS
#               (default 4096,16384) in each arm of WSGEMM_ARMS (default none, wgmma-gemm-f16x, wgmma-gemm-dq, twice),
#               then 16384 at 12 GiB off and with wgmma-gemm (WSGEMM_12=0 skips those)
#     tmagemm   #17: tma-gemm (the default on sm_90) against --kernels-off tma-gemm in one lease: resident prompts
#               TMA_PROMPTS (default 512,4096,16384,32768) on, off, on, off; 16384 at 12 GiB and 4096 at 8 GiB on and
#               off; then tools/prompt_profile.py (each kernel's time, the GEMMs' and attention's share of the
#               tensor cores' rate measured in the same run) at TMA_PROFILE (default 4096,16384) on and off.
#               Knobs: TMA_VARIANTS=512,1024,...: first tools/prompt_variants.py --tma-gemm (one load, the first
#               prompt of each arm timed apart); TMA_BENCH=0, TMA_BUDGETS=0 and TMA_PROFILE=0 skip those parts
#     wsprompt  #17 / #14: the warp-specialized wgmma prompt attention (cuda/attention_ws.cu, Dh 128, on trial under
#               --kernels-on wgmma-attention, its TMA build where the host knows the cells): test_attention_tc_gpu
#               over tc, the wgmma path and the TMA build, then while the pack is made tools/attention_wg_ab.py on the
#               carried fatbins (tc, ws128, wst and WS_EXTRA's arms, at 512 to 4096 after 126,976 cells; then tc
#               and the Dh-256 TMA build at Qwen3-Next-80B's shape; WS_NCU=1: then Nsight Compute over wst), then
#               resident prompts
#               WS_PROMPTS (default 4096,16384,32768) with the path off, on, off, on (one load each); the sha256
#               of the logits differ (other tiles, other roundings)
#     pdlchain  tools/pdl_chain_bench.py on .whl/pdl_stage.fatbin (nvcc -fatbin -arch=sm_90 -Icuda tools/variants/pdl_stage.cu):
#               chains of Q8_0 decode GEMVs from a graph with PDL, W read from global memory against W moved into
#               shared memory before or after griddepcontrol.wait (#16: what a kernel's fixed cost leaves), and
#               the whole chain as ONE persistent launch with grid barriers between its GEMVs (arms persist,
#               persistL, persist3: the persistent decode kernel's question, 37th session)
#     normab    tools/norm_chain_bench.py (during the pack): this build's strata_add_rms_norm_f32 against a parent
#               decode_fused fatbin (NORM_PARENT, default .whl/decode_fused_parent.fatbin: nvcc -fatbin -arch=sm_90
#               -Icuda of the parent's cuda/decode_fused.cu), 96 norms and 48 (q|k|v, norm) from graphs with PDL
#     onerow    tools/decode_variants.py --one-row at context 512 (the one-token GEMVs one row a warp, grids capped at
#               8 and 4 blocks an SM, against the default, A B C A B C), then decode_profile --graphs-only with
#               one-row-gemv on (the default) and off (#16)
#     tlb       (while the pack is made) tools/moe_decode_bench.py, Q4_K at 1 and 4 tokens, routing over a pool of 256
#               experts (680 MB), of TLB_EXPERTS (6144: 16 GB, a resident qwen3-30b-a3b's), of 256 again: what spreading
#               the experts over a whole model's memory costs the MoE decode kernels (address translation)
#     decodegap tools/decode_gap.py at context 512: the step's graph back to back, with the greedy pick's copy and
#               sync after each, and the generation loop (runner.decode + pick): the bubble and the Python a token
#     (wsprompt knobs: WS_AB30=0 skips the Dh-128 A/B, WS_BENCH=0 the resident prompt benches, WS_TEST_K its GPU test's -k)
#     tcdecode  the f16 decode attention on the tensor cores (cuda/attention_dec_tc.cu, for rows of
#               TC_DECODE_FROM cells and more) against attention.cu's: test_attention_gpu and the windowed
#               ring test over both kernels, tools/kv_attention_bench.py's f16 and f16tc rows at 16K, 32K and
#               131K cells, then resident decode after 512, 16384 and 32768 with and without the path
#               (--kernels-off tc-decode-attention; past TC_DECODE_FROM the logits sha256 of the two arms
#               differ: the sums are rounded in another order)
#     attnab    tools/decode_variants.py --attention: the f16 decode attention's two kernels alternated
#               (A B A B) on one load at contexts 512, 4096, 16384 and 32768 (ATTNAB_CONTEXTS overrides;
#               #16: where each kernel is the faster)
#     tcres     tcdecode's resident decode arms alone (its tests and kernel bench run elsewhere:
#               spec_kv_device_check.sh's tests and kvbench, whose formats include f16tc)
# DEADLINE_S (default 570) bounds the whole run, TESTS_S (default 240) the build and tests; logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPT_ARGS=("$@")
. tools/device_deadline.sh
device_setup decode-check tests variants bench

start_pack "${PACK_SHAPE:-qwen3-30b-a3b}" 240     # PACK_SHAPE: another synthetic shape (decodegap's)
pdl_chain() {           # #16: decode GEMVs that move W into shared memory before the PDL wait (tools/variants/pdl_stage.cu)
    echo "== GEMV chains from graphs, W from global memory or staged before the wait ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/pdl_chain_bench.py --fatbin .whl/pdl_stage.fatbin --json "$OUT/pdl_chain.json" 2>&1 | tail -48
    echo "== the same, every kernel asking for the largest shared-memory carveout ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/pdl_chain_bench.py --fatbin .whl/pdl_stage.fatbin --carveout 100 --chains alt,small,smallE \
        --arms plain,stage,early,persist --json "$OUT/pdl_chain_c100.json" 2>&1 | grep -v "^check" | tail -16
}
norm_ab() {             # #16: this build's add + RMSNorm against NORM_PARENT's decode_fused fatbin, chains from graphs
    echo "== add + RMSNorm chains: this build against ${NORM_PARENT:-.whl/decode_fused_parent.fatbin} ($(elapsed) s)"
    timeout "$(budget 60)" $PY tools/norm_chain_bench.py --arm new:strata/kernels/decode_fused.fatbin \
        --arm parent:"${NORM_PARENT:-.whl/decode_fused_parent.fatbin}" --json "$OUT/normab.json" 2>&1 | tail -9
}
tlb_bench() {           # #16: do the MoE decode kernels slow down when the routed experts are spread over a resident
                        # model's 16 GB rather than a 680 MB pool (address translation: each expert is 2.65 MB)?
    local n
    for n in 256 ${TLB_EXPERTS:-6144} 256; do
        echo "== MoE decode kernels, a pool of $n Q4_K experts ($(( n * 2654208 / 1048576 )) MiB) ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/moe_decode_bench.py --types Q4_K --tokens 1,4 --blocks-per-sm 2 --experts "$n" \
            --json "$OUT/tlb_$n.json" 2>&1 | tail -3
    done
}
if ! has wsprompt; then
    during_pack() { if has pdlchain; then pdl_chain; fi; if has normab; then norm_ab; fi; if has tlb; then tlb_bench; fi; }
fi
if has wsprompt; then
    during_pack() {     # the kernels alone, from the carried fatbins, while the pack is made
        if has pdlchain; then pdl_chain; fi
        if has normab; then norm_ab; fi
        local W=.whl WS=128:384:163968 WST=128:384:164928:tma
        echo "== attention A/B: tc, ws128, wst ${WS_EXTRA:-} ($(elapsed) s)"
        [ "${WS_AB30:-1}" = 0 ] || timeout "$(budget 150)" $PY tools/attention_wg_ab.py --arm tc:$W/attention_tc.fatbin:strata_attention_prefill_tc_f16 \
            --arm ws128:$W/attention_ws.fatbin:strata_attention_prefill_ws128_f16:$WS \
            --arm wst:$W/attention_ws.fatbin:strata_attention_prefill_wst128_f16:$WST ${WS_EXTRA:-} \
            --json "$OUT/attention_ab.json" 2>&1 | grep -v " ok  " | tail -16
        echo "== attention A/B at Qwen3-Next-80B's shape (Dh 256): tc, wst64 ($(elapsed) s)"
        timeout "$(budget 120)" $PY tools/attention_wg_ab.py --arm tc:$W/attention_tc.fatbin:strata_attention_prefill_tc_f16 \
            --arm wst64:$W/attention_ws.fatbin:strata_attention_prefill_wst64_f16:128:384:197696:tma64 --shape 80b \
            --json "$OUT/attention_ab_80b.json" 2>&1 | grep -v " ok  " | tail -12
        [ -n "${WS_NCU:-}" ] || return 0
        echo "== Nsight Compute over wst, 4096 queries after 12,288 cells ($(elapsed) s)"
        timeout "$(budget 120)" ncu -k regex:prefill_wst128_f16_d128 --launch-skip 3 --launch-count 1 --section SpeedOfLight \
            --section WarpStateStats --section SchedulerStats --section SourceCounters $PY tools/attention_wg_ab.py \
            --arm wst:$W/attention_ws.fatbin:strata_attention_prefill_wst128_f16:$WST --chunks 4096@12288 --repeats 1 \
            > "$OUT/ncu_ws.txt" 2>&1
        grep -E "Duration|L2 Cache Throughput|Compute \(SM\)|Eligible Warps|Warp Cycles Per Issued|excessive" "$OUT/ncu_ws.txt" | head -12
    }
fi
if has gemmab; then     # the prompt GEMM's carried fatbins (tools/variants/gemm_ws_ab.sh) while the pack is made
    if declare -F during_pack > /dev/null; then eval "$(declare -f during_pack | sed '1s/during_pack/during_pack_first/')"; fi
    during_pack() {
        if declare -F during_pack_first > /dev/null; then during_pack_first; fi
        echo "== prompt GEMM A/B: ${GEMMAB_ARMS:-every arm} ($(elapsed) s)"
        OUT=$OUT timeout "$(budget 240)" bash tools/variants/gemm_ws_ab.sh ${GEMMAB_ARMS:-} 2>&1 | tail -40
    }
fi
if has tests; then
    device_tests "${TESTS_S:-240}" 12 ${TESTS:-tests/kernels/test_build.py tests/kernels/test_gemv_gpu.py tests/kernels/test_decode_fused_gpu.py \
        tests/kernels/test_moe_decode_gpu.py tests/engine/test_cuda_runner.py}
else
    device_tests 240 3      # the build alone takes 65-125 s on a fresh machine
fi

export BENCH_LINES="^prompt|^decode|copy|^plan|^peak|stopped"
if has variants; then
    for ctx in 512 16384; do
        echo "== decode variants, context $ctx ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/decode_variants.py --context $ctx --decode 128 \
            --json "$OUT/variants_$ctx.json" 2>&1 | tail -5
    done
fi
if has bench; then
    bench_synthetic resident 70 qwen3-30b-a3b --prompt 512,16384 --decode 64
fi
if has budget; then
    for gib in 12 8; do
        bench_synthetic b${gib} 70 qwen3-30b-a3b --vram-budget-gib $gib --prompt 512 --decode 64
    done
fi
if has profile; then
    echo "== decode profile ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/decode_profile.py --graphs-only --context 512 --json "$OUT/profile.json" 2>&1 | tail -30
fi
if has rows; then        # which kernels grow with a batched step's rows (#19's 4 clients, #16's batched path)
    for n in 1 4; do
        echo "== decode profile, $n row(s) ($(elapsed) s)"
        timeout "$(budget 100)" $PY tools/decode_profile.py --context 192 --rows $n --steps 5 \
            --json "$OUT/profile_rows$n.json" 2>&1 | grep -v "^  timing " | head -45
    done
fi
par_resident() {        # par_resident JSON [args...]: parallel slots resident at 1 and 4 clients, the ratio lines
    local json=$1; shift
    timeout "$(budget 70)" $PY tools/parallel_bench.py --synthetic qwen3-30b-a3b --budget-gib 0 --batch-max 0 \
        --clients 1,4 --warm 16 --long 0 "$@" --json "$OUT/$json" 2>&1 | grep -E "clients:|x\)" | head -6
}
gemv_arm() {            # the batched step's kernel table and parallel slots, as this arm's fatbins give them
    echo "== gemv arm $1 ($(elapsed) s)"
    if [ -n "${GEMV_ARM_TESTS:-}" ]; then    # the arm's bits: every batched row equals its one-token launch
        timeout "$(budget 60)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_row_invariant_gpu.py \
            -k "gemv" 2>&1 | tail -2
    fi
    timeout "$(budget 60)" $PY tools/decode_profile.py --context 192 --rows 4 --steps 5 --json "$OUT/gemv_$1.json" 2>&1 \
        | grep -E "^decode step|gemv|moe_(gate|down)" | head -8
    par_resident "gemv_par_$1.json" ${PAR_CONTEXT:+--context $PAR_CONTEXT}
}
if has gemvab; then      # the batched GEMVs' weights converted once a batch (gemv_rows.cuh) against parents
    for arm in ${GEMV_ARMS:-}; do
        IFS=: read -r name gf df mf <<<"$arm"
        cmd=(gemv_arm "$name")
        [ -n "$mf" ] && [ "$mf" != "-" ] && cmd=(with_fatbin moe_decode "$mf" "${cmd[@]}")
        [ "$df" != "-" ] && cmd=(with_fatbin decode_fused "$df" "${cmd[@]}")
        [ "$gf" != "-" ] && cmd=(with_fatbin gemv "$gf" "${cmd[@]}")
        "${cmd[@]}"
    done
    gemv_arm tree
fi
if has routeab; then    # #16: one launch fewer a layer
    echo "== decode variants --route ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/decode_variants.py --route --context 512 --decode 256 \
        --json "$OUT/routeab.json" 2>&1 | tail -5
    for arm in fused apart; do
        echo "== parallel slots, route $arm ($(elapsed) s)"
        on=""; [ "$arm" = fused ] && on=fused-route
        STRATA_KERNELS_ON=$on par_resident "route_par_$arm.json" --context 1024
    done
fi
if has inmoe; then      # #16: moe_route's launch folded into gate|up's blocks
    echo "== decode variants --route-in-moe ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/decode_variants.py --route-in-moe --context 512 --decode 256 \
        --json "$OUT/inmoe_variants.json" 2>&1 | tail -9
    for off in "" route-in-moe,norm-in-router; do
        echo "== decode profile, kernels off: ${off:-none} ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/decode_profile.py --graphs-only --context 512 --kernels-off "$off" \
            --json "$OUT/inmoe_profile_$([ -n "$off" ] && echo off || echo on).json" 2>&1 | grep -E "step|rout|gate_up|moe_down|norm|gemv_split_f32" | head -14
    done
    arms=("" route-in-moe,norm-in-router); [ "${INMOE_B12_ROUNDS:-2}" = 2 ] && arms+=("" route-in-moe,norm-in-router)
    for off in "${arms[@]}"; do
        bench_synthetic "inmoe_b12_$([ -n "$off" ] && echo off || echo on)" 70 qwen3-30b-a3b --vram-budget-gib 12 --prompt 512 \
            --decode "${INMOE_DECODE:-128}" ${off:+--kernels-off $off}
    done
    for off in "" route-in-moe,norm-in-router; do
        bench_synthetic "inmoe_res_$([ -n "$off" ] && echo off || echo on)" 80 qwen3-30b-a3b \
            --prompt "${INMOE_RES_PROMPTS:-512,16384}" --decode 128 ${off:+--kernels-off $off}
    done
fi
if has ctx16; then       # #16: decode after 16,384 cells, the step's kernels and the 32nd session's changes there
    echo "== decode profile at context ${CTX16_CONTEXT:-16384} ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/decode_profile.py --graphs-only --context "${CTX16_CONTEXT:-16384}" \
        --json "$OUT/ctx16_profile.json" 2>&1 | grep -vE "^  timing" | tail -16
    for arm in default apart precombine default; do
        case $arm in
            apart) bench_synthetic ctx16_apart 80 qwen3-30b-a3b --prompt "${CTX16_CONTEXT:-16384}" --decode 128 \
                       --kernels-off route-in-moe,norm-in-router ;;
            precombine) [ -f .whl/attention_precombine.fatbin ] && with_fatbin attention .whl/attention_precombine.fatbin \
                            bench_synthetic ctx16_precombine 80 qwen3-30b-a3b --prompt "${CTX16_CONTEXT:-16384}" --decode 128 ;;
            *) bench_synthetic "ctx16_$arm" 80 qwen3-30b-a3b --prompt "${CTX16_CONTEXT:-16384}" --decode 128 ;;
        esac
    done
fi
combine_arms() {         # name=fatbin pairs of the `combine` step's variant builds that were carried
    local a
    for a in ${COMBINE_ARMS:-precombine skiplist plain}; do
        [ -f ".whl/attention_$a.fatbin" ] && echo "$a:attention=.whl/attention_$a.fatbin"
    done
}
if has combine; then     # #16: which decode combine (splits up to the last used / every split / a list of used ones)
    for arm in tree $(combine_arms | cut -d: -f1); do
        echo "== combine arm $arm: GPU tests ($(elapsed) s)"
        cmd=(timeout "$(budget 90)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_attention_gpu.py -k combine
             tests/kernels/test_kv_decode_digest_gpu.py)
        [ "$arm" != tree ] && cmd=(with_fatbin attention ".whl/attention_$arm.fatbin" "${cmd[@]}")
        "${cmd[@]}" 2>&1 | tail -1
    done
    for ctx in ${COMBINE_CONTEXTS:-16384 512}; do
        echo "== decode variants --fatbin-arms, context $ctx ($(elapsed) s)"
        timeout "$(budget 150)" $PY tools/decode_variants.py --fatbin-arms "$(combine_arms | paste -sd';')" --context "$ctx" \
            --decode "$([ "$ctx" -gt 4096 ] && echo 128 || echo 256)" --json "$OUT/combine_variants_$ctx.json" 2>&1 | tail -7
    done
    for arm in tree $(combine_arms | cut -d: -f1); do
        echo "== kv_attention_bench, $arm ($(elapsed) s)"
        cmd=(timeout "$(budget 60)" $PY tools/kv_attention_bench.py --cells 512,16384 --formats f16,f16tc
             --json "$OUT/combine_kvbench_$arm.json")
        [ "$arm" != tree ] && cmd=(with_fatbin attention ".whl/attention_$arm.fatbin" "${cmd[@]}")
        "${cmd[@]}" 2>&1 | tail -6
    done
    echo "== decode profile at context 16384 ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/decode_profile.py --graphs-only --context 16384 \
        --json "$OUT/combine_profile.json" 2>&1 | grep -vE "^  timing" | tail -14
fi
if has cluster; then    # #16: short rows' decode attention in one cluster launch (--kernels-on cluster-decode)
    echo "== kv_attention_bench f16 (splits for a 40,960-cell cache) against f16cl ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/kv_attention_bench.py --cells ${CLUSTER_CELLS:-256,512,1024,2048} --formats f16,f16cl \
        --cache-cells 40960 --json "$OUT/cluster_kvbench.json" 2>&1 | tail -9
    echo "== decode variants --cluster, context 512 ($(elapsed) s)"
    timeout "$(budget 150)" $PY tools/decode_variants.py --cluster --context 512 --decode 96 \
        --json "$OUT/cluster_variants.json" 2>&1 | tail -5
    bench_synthetic cluster_on 70 qwen3-30b-a3b --prompt 512 --decode 128 --kernels-on cluster-decode
    bench_synthetic cluster_off 70 qwen3-30b-a3b --prompt 512 --decode 128
fi
if has routerab; then   # #16: the routers' top-k, arm against arm
    for arm in ${ROUTER_ARMS:-}; do
        IFS=: read -r name gf rf rg <<<"$arm"
        echo "== router bench, $name ($(elapsed) s)"
        cmd=(timeout "$(budget 60)" $PY tools/router_bench.py --router-grid "${rg:-0}" --json "$OUT/router_$name.json")
        [ "$rf" != "-" ] && cmd=(with_fatbin moe_route "$rf" "${cmd[@]}")
        [ "$gf" != "-" ] && cmd=(with_fatbin gemv "$gf" "${cmd[@]}")
        "${cmd[@]}" 2>&1 | tail -10
    done
    echo "== router bench, tree ($(elapsed) s)"
    timeout "$(budget 60)" $PY tools/router_bench.py --json "$OUT/router_tree.json" 2>&1 | tail -10
fi
if has partrace; then   # #19: the scheduler's iterations under a budget, split into steps, rows alone and prompts
    for arm in ${PARTRACE_EMPTY:-tree}; do     # tree, or N: ADMIT_EMPTY_PER_STEP patched to N for an A/B
        echo "== parallel slots traced at ${PARTRACE_GIB:-12} GiB, admissions into empty slots: $arm ($(elapsed) s)"
        pre="import runpy, sys"
        [ "$arm" != tree ] && pre="$pre; import strata.engine.experts.admissions as a; a.ADMIT_EMPTY_PER_STEP = $arm"
        timeout "$(budget 240)" $PY -c "$pre; sys.argv = ['parallel_bench.py'] + sys.argv[1:]; sys.path.insert(0, 'tools'); \
runpy.run_path('tools/parallel_bench.py', run_name='__main__')" --synthetic qwen3-30b-a3b --budget-gib "${PARTRACE_GIB:-12}" \
            --clients "${PARTRACE_CLIENTS:-1,2,4}" --warm 16 --long 0 --context 1024 --trace \
            --json "$OUT/partrace_$arm.json" 2>&1 | tail -40
    done
fi
if has parfull; then    # #19's table: resident slots at 1, 2, 4 and 8 clients, and a short request beside a 16K prompt
    echo "== parallel slots, resident, with the long-prompt round ($(elapsed) s)"
    timeout "$(budget 200)" $PY tools/parallel_bench.py --synthetic qwen3-30b-a3b --budget-gib 0 --batch-max 0 \
        --clients 1,2,4,8 --warm 16 --context 1024 --json "$OUT/parfull.json" 2>&1 | grep -vE "^strata: (pinning|uploading)" | tail -20
fi
if has fit; then         # what bounds a one-token launch: a fixed cost or the bytes (#16)
    echo "== MoE decode fit ($(elapsed) s)"
    for A in 1 2 4 8; do
        timeout "$(budget 40)" $PY tools/moe_decode_bench.py --types "${FIT_TYPES:-Q4_K}" --tokens 1 --A "$A" \
            --json "$OUT/fit_A$A.json" > "$OUT/fit_A$A.log" 2>&1 || tail -3 "$OUT/fit_A$A.log"
    done
    $PY tools/moe_decode_fit.py "$OUT"/fit_A*.json
fi
has ncu && ncu_moe_decode
has moeab && moe_decode_ab
has ttft && ttft_serve qwen3-30b-a3b
if has gemm; then
    echo "== moe_gemm bench ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/moe_gemm_bench.py --repeats 20 2>&1 | tail -25
    bench_synthetic prompt 60 qwen3-30b-a3b --prompt 512,4096,16384 --decode 0
fi
if has wgprompt; then    # #17: the prompt kernels on Hopper's warpgroup MMA against mma.sync, one lease
    echo "== moe_gemm and prompt attention GPU tests, both builds ($(elapsed) s)"
    timeout "$(budget 180)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gemm_gpu.py \
        tests/kernels/test_attention_tc_gpu.py 2>&1 | tail -4
    for op in ${WSGEMM_BENCH_OPS-moe_gemm moe_gemm_ws}; do     # WSGEMM_BENCH_OPS= skips them (gemmab times the kernels)
        echo "== $op bench ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/moe_gemm_bench.py --repeats 20 --op $op --json "$OUT/gemm_$op.json" 2>&1 | tail -9
    done
    for arm in none wgmma-gemm,wgmma-attention wgmma-gemm wgmma-attention; do
        on=(); [ "$arm" != none ] && on=(--kernels-on "$arm")
        bench_synthetic "prompt_${arm//,/+}" 60 qwen3-30b-a3b --prompt 512,4096,16384 --decode 0 "${on[@]}"
    done
    bench_synthetic p12_none 60 qwen3-30b-a3b --vram-budget-gib 12 --prompt 16384 --decode 0
    bench_synthetic p12_both 60 qwen3-30b-a3b --vram-budget-gib 12 --prompt 16384 --decode 0 \
        --kernels-on wgmma-gemm,wgmma-attention
fi
if has wsgemm; then      # #17: the prompt GEMMs warp-specialized on wgmma (cuda/moe_gemm_ws.cu) against mma.sync
    echo "== moe_gemm GPU tests, both builds, and the f16 dequantization ($(elapsed) s)"
    timeout "$(budget 150)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gemm_gpu.py \
        "tests/kernels/test_dequant_gpu.py::test_dequant_h_is_f16_of_the_exact_weights" \
        "tests/kernels/test_dequant_gpu.py::test_dequant_h_groups_writes_each_blob_and_skips_null_ones" \
        ${WSGEMM_TEST_K:+-k "$WSGEMM_TEST_K"} 2>&1 | tail -4
    for spec in ${WSGEMM_OPS:-moe_gemm moe_gemm_ws}; do     # OP or OP:--f16 (every shape as F16)
        op=${spec%%:*}; extra=(); [ "$spec" != "$op" ] && extra=("${spec#*:}")
        echo "== $op ${extra[*]} bench ($(elapsed) s)"
        timeout "$(budget 60)" $PY tools/moe_gemm_bench.py --repeats 20 --op $op "${extra[@]}" \
            --json "$OUT/gemm_$op${extra:+_f16}.json" 2>&1 | tail -9
    done
    if [ -n "${WSGEMM_N256:-}" ]; then    # the TMA GEMM as the 256-row trial build (.whl/moe_gemm_ws_n256.fatbin)
        echo "== moe_gemm_wst, 256-row build ($(elapsed) s)"
        with_fatbin moe_gemm_ws .whl/moe_gemm_ws_n256.fatbin timeout "$(budget 60)" $PY tools/moe_gemm_bench.py \
            --repeats 20 --op moe_gemm_wst --ws-build 256 --json "$OUT/gemm_wst256.json" 2>&1 | tail -9
    fi
    for arm in ${WSGEMM_ARMS:-none wgmma-gemm-f16x wgmma-gemm-dq none wgmma-gemm-f16x wgmma-gemm-dq}; do
        on=(); [ "$arm" != none ] && on=(--kernels-on "$arm")
        bench_synthetic "prompt_$arm" 60 qwen3-30b-a3b --prompt ${WSGEMM_PROMPTS:-4096,16384} --decode 0 "${on[@]}"
    done
    if [ "${WSGEMM_12:-1}" = 1 ]; then
        bench_synthetic p12_none 60 qwen3-30b-a3b --vram-budget-gib 12 --prompt 16384 --decode 0
        bench_synthetic p12_ws 60 qwen3-30b-a3b --vram-budget-gib 12 --prompt 16384 --decode 0 --kernels-on wgmma-gemm
    fi
fi
if has tmagemm; then     # #17: the prompt GEMMs over f16 weights by the TMA (the default) against the decoding GEMMs
    if [ -n "${TMA_VARIANTS:-}" ]; then     # e.g. 512,1024,2048,4096: both arms on one load, first prompts apart
        echo "== prompt variants, tma-gemm off and on: $TMA_VARIANTS ($(elapsed) s)"
        timeout "$(budget 120)" $PY tools/prompt_variants.py --tma-gemm --prompt "$TMA_VARIANTS" --repeats 3 2>&1 | tail -24
    fi
    [ "${TMA_BENCH:-1}" = 0 ] || for arm in on off on off; do
        off=(); [ "$arm" = off ] && off=(--kernels-off tma-gemm)
        bench_synthetic "tma_$arm" 90 qwen3-30b-a3b --prompt "${TMA_PROMPTS:-512,4096,16384,32768}" --decode 0 "${off[@]}"
    done
    [ "${TMA_BUDGETS:-1}" = 0 ] || for arm in on off; do
        off=(); [ "$arm" = off ] && off=(--kernels-off tma-gemm)
        bench_synthetic "tma12_$arm" 60 qwen3-30b-a3b --vram-budget-gib 12 --prompt 16384 --decode 0 "${off[@]}"
        bench_synthetic "tma8_$arm" 60 qwen3-30b-a3b --vram-budget-gib 8 --prompt 4096 --decode 0 "${off[@]}"
    done
    [ "${TMA_PROFILE:-}" = 0 ] || for off in "" tma-gemm; do
        echo "== prompt profile, kernels off: ${off:-none} ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/prompt_profile.py --prompt "${TMA_PROFILE:-4096,16384}" --kernels-off "$off" \
            --top "${TMA_TOP:-8}" --json "$OUT/prompt_profile_${off:-none}.json" 2>&1 | tail -40
    done
fi
if has wsprompt; then    # #17 / #14: the warp-specialized wgmma prompt attention against attention_tc.cu
    echo "== prompt attention GPU tests, tc and the wgmma path ($(elapsed) s)"
    timeout "$(budget 150)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_attention_tc_gpu.py ${WS_TEST_K:+-k "$WS_TEST_K"} 2>&1 | tail -4
    [ "${WS_BENCH:-1}" = 0 ] || for arm in none wgmma-attention none wgmma-attention; do
        on=(); [ "$arm" != none ] && on=(--kernels-on "$arm")
        bench_synthetic "wsprompt_$arm" 60 qwen3-30b-a3b --prompt "${WS_PROMPTS:-4096,16384,32768}" --decode 0 "${on[@]}"
    done
fi
if has onerow; then      # #16: the one-token GEMVs one row a warp (one-row-gemv) against 4 rows a warp
    echo "== decode variants --one-row, context 512 ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/decode_variants.py --one-row --context 512 --decode 256 \
        --json "$OUT/onerow_512.json" 2>&1 | tail -7
    for off in "" one-row-gemv; do
        echo "== decode profile, kernels off: ${off:-none} ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/decode_profile.py --graphs-only --context 512 --kernels-off "$off" \
            --json "$OUT/profile_onerow_off_${off:-none}.json" 2>&1 | tail -${ONEROW_PROFILE_LINES:-14}
    done
fi
if has decodegap; then   # #16: the graph alone, with the pick's sync, and the generation loop
    echo "== decode gap, context 512 ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/decode_gap.py --synthetic "${PACK_SHAPE:-qwen3-30b-a3b}" --context 512 \
        --json "$OUT/decode_gap.json" 2>&1 | tail -4
    for gib in ${GAP_BUDGETS:-}; do     # e.g. GAP_BUDGETS="12 8" (the 30B shape)
        echo "== decode gap at $gib GiB ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/decode_gap.py --synthetic "${PACK_SHAPE:-qwen3-30b-a3b}" --context 512 \
            --budget-gib "$gib" --rounds 2 --json "$OUT/decode_gap_$gib.json" 2>&1 | tail -3
    done
fi
if has tcdecode || has tcres; then   # #16 / #14: f16 decode attention on the tensor cores against the CUDA cores
    if has tcdecode; then
        echo "== f16 decode attention GPU tests, both kernels ($(elapsed) s)"
        timeout "$(budget 150)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_attention_gpu.py \
            "tests/engine/test_spec_gpu.py::test_windowed_ring_decode_kernels" 2>&1 | tail -4
        echo "== kv attention bench, f16 kernels ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/kv_attention_bench.py --cells 16384,32768,131072 --formats f16,f16tc \
            --json "$OUT/kv_f16tc.json" 2>&1 | tail -7
    fi
    for arm in tc-decode-attention none; do
        off=(); [ "$arm" = none ] && off=(--kernels-off tc-decode-attention)
        bench_synthetic "decode_$arm" 80 qwen3-30b-a3b --prompt 512,16384,32768 --decode 64 "${off[@]}"
    done
fi
if has attnab; then
    echo "== f16 decode attention, attention.cu against attention_dec_tc.cu ($(elapsed) s)"
    timeout "$(budget 150)" $PY tools/decode_variants.py --attention --context "${ATTNAB_CONTEXTS:-512,4096,16384,32768}" --decode 64 \
        --json "$OUT/attnab.json" 2>&1 | tail -8
fi
echo "== done at $(elapsed) s"
