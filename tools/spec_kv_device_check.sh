#!/usr/bin/env bash
# Speculation under budgets (#13), seed 001's room, long-context quantized K/V (#14) and the GPU tests
# that have not run on a device yet, in one device call inside a deadline. The synthetic packs are
# built on the CPUs while tools/device_check.sh builds and runs the GPU tests; then the benches.
#
#   tools/spec_kv_device_check.sh [steps...]     default: tests spec12 room
#     tests    build + GPU tests never run on a device (TESTS overrides): --kv-resident, Qwen3-Next
#              streamed, the spec tests (window graphs under budgets and quantized K/V)
#     spec12   bench at 12 GiB, qwen3-30b-a3b-mtp: --mtp --spec 2 --prompt 4096 (windows at a budget,
#              the draft layer's prompt cells inside the loan) and --spec auto against plain
#     room     seed 001's A/B at 8 GiB on qwen3-30b-a3b-mtp: prompts 64,4096,16384,32768 with
#              --mtp-room-min 1024 (the 64-token one under the threshold) against -1, and the 64-token
#              one alone with --mtp-room-min 0 (a short prompt that pays the copy back); bench prints
#              each prompt's logits sha256 and whether the room was lent
#     specn    --mtp --spec N for N = 1..4 at 12 GiB, prompt 512, 64 greedy tokens: random weights reject
#              every draft, so a verify pass emits one token and costs a window of N + 1 rows plus N
#              draft steps in steady decode (time_windows' best-of-3 at a budget times admissions)
#     short    a 64-token prompt with the room lent (--mtp-room-min 0) against under the threshold
#              (1024), the same plan in both (a 32768-token prompt sizes the context)
#     long     qwen3-30b-a3b-128k at 12 GiB, --kv q4_0: a 131,008-token prompt (the bench clips it to the
#              131,072-token context less the decode) and 64 decoded tokens
#     gdn      tools/gdn_chunk_bench.py --sweep (the chunked Gated DeltaNet prompt kernels, #15)
#     gdndec   tools/gdn_chunk_bench.py --decode: the decode step's DeltaNet kernels (gdn_step,
#              conv1d_step) at 80B's shape in GB/s against a device copy in the same run (#15); with
#              GDN_PARENT=<file>, an earlier cuda/gated_delta.cu (e.g. `git show C:cuda/gated_delta.cu`
#              into a carried path) built aside and its gdn_step timed too
#     kvdigest tools/kv_decode_digest.py with this build's cuda/kv_quant.cu and with KV_PARENT's (another
#              kv_quant.cu carried in .whl/: an earlier one (`git show C:cuda/kv_quant.cu`) or a variant,
#              built aside and swapped into strata/kernels for one run): the diff of the two must be
#              empty (a load-path change that keeps the sums bit for bit)
#     kvbench  tools/kv_attention_bench.py --cells 16384,32768,131072 (KV_CELLS; quantized decode attention,
#              #14); with KV_PARENT, then over that kv_quant.cu, then this build again (the A/B in one call)
#     kvnsub   the quantized split-K decode with a warp tile of 16 cells (NSUB 1 at Dh 128: 166 registers
#              against 245) built at __launch_bounds__(128, N) for N = 3, 4 and 2, each timed with splits for
#              N blocks a multiprocessor against this build (#14: q4_0 is latency-bound at two blocks),
#              then test_kv_quant_gpu over the N = 3 build (the sums run in another order: not the digests)
#     kvring   the quantized split-K decode with its cp.async ring (Dh 128, sm_90: kernels.decode_quant_shared)
#              against the same build's register path (--registers), ring / registers / ring / registers, at
#              KV_CELLS (default 32768,131072), KV_FORMATS (default int8,k8v4,q4_0), each launch another layer's cache
#     kvring1  the ring on short splits too: a build with DecodeQ::RING_FROM = KV_RING_TILES (default 2) tiles a
#              warp, timed at --blocks-per-sm 1 and 2 (splits for one or two blocks a multiprocessor: one block
#              of 4 warps with 4 tiles each in flight against two with a tile each), ring against registers,
#              at KV_CELLS (default 32768,65536); #14's 32K case, where four tiles a warp left the ring behind
#     ringmodel  the ring in the model: bench resident, q4_0 K/V, prompt RING_PROMPT (default 32768) and 64
#              decoded tokens, with it and with --kernels-off kv-ring (RING_ARMS, default "ring off ring")
#     kvncu    Nsight Compute over the int8 and q4_0 split-K decode kernels at 32K cells (device_deadline.sh's
#              ncu_kv): this build, then KV_PARENT's when given
#     tcbench  tools/attention_tc_bench.py --shape 80b (the head_dim-256 tensor-core prompt attention)
#     batchres tools/parallel_bench.py resident, --batch-max auto, 1, 2, 4 and 8 clients, no long prompt (#19)
#     split    --cpu-experts auto against off at 8 GiB: prompts of 19, 64 and 512 tokens, 32 decoded (#18)
#     splitcap the split arms with the bus capped at 25 GB/s (--pcie-gbs 25: a PCIe 4.0 slot), where
#              the cost model still gives the host a share of the short prompts
#     prefill  --prefill auto's cost-model plan against --prefill-rule bytes and slots at 8 and 12 GiB,
#              prompts 4096,16384,32768 and nothing decoded (#18 item 4; bench's plan line names the
#              chunk, ring and kept slots each took and auto's predicted tok/s), ~30 s an arm;
#              PREFILL_GIBS (default "8 12") and PREFILL_RULES (default "auto bytes slots") narrow it
#     p2048    prompts 512 and 2048 at 12 GiB, 32 decoded, --cpu-experts off against auto (#18's targets)
#     p2048cap the same with the bus capped at 25 GB/s (--pcie-gbs 25: a PCIe 4.0 slot)
#     layers   the layer split (#21) on qwen3-30b-a3b-mtp: --gpus 0,1 at 8+8 GiB (0,0 where the machine has one
#              GPU: two logical cards on it), against one card at 16 and at 8 GiB; prompt 4096, 64 decoded;
#              bench's plan line gives the split, each card's cache and the hand-off's time a step
#     dsplit   the decode split (#18): 8 GiB, a 19-token prompt and 32 decoded, --cpu-experts off, auto and
#              1 (every miss a step takes on the host), at the full bus and capped at 25 GB/s
#     ttft     tools/ttft_server.py: `strata serve` at 8 GiB, six short chat turns' time to first token (#18)
#     share    tools/slot_share_bench.py on qwen3-30b-a3b-mtp, resident and at 12 GiB, --parallel 2: slot 1's
#              first token after an 8192-token prefix slot 0 holds, copied between the slots against read again
#     ncu      Nsight Compute over the MoE decode kernels (device_deadline.sh's ncu_moe_decode, #16)
#     batch    tools/parallel_bench.py at 12 GiB, --batch-max auto against 1, 1 and 4 clients (#19)
#     ttft12   tools/parallel_bench.py's long round at 12 GiB: a 19-token request's first token while a
#              16384-token prompt streams in the plan's chunks (each under its own loan), against alone (#19)
#     kvres    qwen3-30b-a3b-mtp at 12 GiB, q4_0 K/V: --kv-resident 4096 (the newest 4096 cells in VRAM over
#              the host's) against all in VRAM, prompt 16384 and 64 decoded tokens (equal logits sha256)
#     draftwin seed 003's A/B on qwen3-30b-a3b-mtp: --draft-window 4096, prompts 8192,16384,32768, the
#              draft layer's prompt cells batched (K/V only, the prompt path's GEMMs) against the
#              drafter's own pass; bench prints the draft layer's cells and time after each chunk
# DEADLINE_S (default 570) bounds the whole run; logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPT_ARGS=("$@")
. tools/device_deadline.sh
device_setup spec-kv-check tests spec12 room

shape=qwen3-30b-a3b-mtp
has long && ! has spec12 && ! has room && ! has specn && ! has short && ! has draftwin && shape=qwen3-30b-a3b-128k
shape=${SHAPE:-$shape}      # the pack the steps read
# the kernel-only steps need no model: on a fresh machine the pack's minute of CPUs would slow the build
pack_steps=0
for s in "${steps[@]}"; do
    case $s in tests|kvdigest|kvbench|kvnsub|kvring|kvring1|kvncu|tcbench|gdn|gdndec) ;; *) pack_steps=1 ;; esac
done
if [ $pack_steps = 1 ]; then start_pack "$shape" 240; else pack_pid=; echo "no pack: no step needs one" >"$OUT/pack.log"; fi

if has tests; then
    device_tests ${TESTS_S:-240} 20 ${TESTS:-tests/engine/test_kv_resident_gpu.py tests/engine/test_qwen3next_gpu.py tests/engine/test_spec_gpu.py tests/engine/test_cuda_runner.py tests/engine/test_kv_gpu_runner.py}
else
    device_tests 240 3      # the build alone takes 65-125 s on a fresh machine
fi

export BENCH_LINES="^prompt|^decode|^specul|^verify|^plan|^peak|^draft layer|stopped"
bench() { bench_synthetic "$@"; }      # bench NAME SECONDS SHAPE ARGS...
if has spec12; then
    bench spec12 90 qwen3-30b-a3b-mtp --vram-budget-gib 12 --mtp --spec 2 --prompt 4096 --decode 64
    bench plain12 70 qwen3-30b-a3b-mtp --vram-budget-gib 12 --prompt 512 --decode 128
    bench auto12 70 qwen3-30b-a3b-mtp --vram-budget-gib 12 --mtp --spec auto --prompt 512 --decode 128
fi
if has room; then
    for arm in "noroom8 -1 64,4096,16384,32768" "room8 1024 64,4096,16384,32768" "shortroom8 0 64"; do
        set -- $arm
        bench "$1" 100 qwen3-30b-a3b-mtp --vram-budget-gib 8 --mtp --spec 2 --mtp-room-min "$2" --prompt "$3" --decode 0
    done
fi
if has specn; then
    for n in 1 2 3 4; do
        bench spec${n}x12 60 qwen3-30b-a3b-mtp --vram-budget-gib 12 --mtp --spec $n --prompt 512 --decode 64
    done
fi
if has short; then
    for arm in "short0 0" "short1024 1024"; do
        set -- $arm
        bench "$1" 60 qwen3-30b-a3b-mtp --vram-budget-gib 8 --mtp --spec 2 --mtp-room-min "$2" --prompt 64,32768 --decode 0
    done
fi
if has long; then
    [ "$shape" != qwen3-30b-a3b-128k ] && { start_pack qwen3-30b-a3b-128k 200; wait $pack_pid; cat "$OUT/pack.log"; }
    bench long12 300 qwen3-30b-a3b-128k --vram-budget-gib 12 --kv q4_0 --prompt 131072 --decode 64
fi
if has draftwin; then
    for mode in batched own; do
        bench "draft_$mode" 150 qwen3-30b-a3b-mtp --mtp --spec 2 --draft-window 4096 --draft-prompt "$mode" \
            --prompt 8192,16384,32768 --decode 0
    done
fi
if has gdn; then        # the chunked delta rule against the token loop at 80B's DeltaNet shape (#15)
    echo "== gdn chunk bench ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/gdn_chunk_bench.py --sweep --json "$OUT/gdn_chunk.json" 2>&1 | tail -30
fi
if has gdndec; then     # the decode step's DeltaNet kernels against the copy rate (#15)
    echo "== gdn decode bench ($(elapsed) s)"
    parent=()
    if [ -n "${GDN_PARENT:-}" ]; then
        build_fatbin "$GDN_PARENT" /tmp/gdn_parent.fatbin \
            && parent=(--parent /tmp/gdn_parent.fatbin)
    fi
    timeout "$(budget 90)" $PY tools/gdn_chunk_bench.py --decode --reps 3 "${parent[@]}" --json "$OUT/gdn_decode.json" 2>&1 | tail -20
fi
if has kvdigest; then   # the quantized decode's outputs, this build against KV_PARENT's kv_quant.cu
    echo "== kv decode digests ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/kv_decode_digest.py >"$OUT/kv_digest_new.txt" 2>&1
    if [ -n "${KV_PARENT:-}" ] && with_parent kv_quant "$KV_PARENT" \
            timeout "$(budget 120)" $PY tools/kv_decode_digest.py >"$OUT/kv_digest_parent.txt" 2>&1; then
        echo "digest lines: $(wc -l <"$OUT/kv_digest_new.txt") new, $(wc -l <"$OUT/kv_digest_parent.txt") parent;" \
            "differing: $(diff "$OUT/kv_digest_new.txt" "$OUT/kv_digest_parent.txt" | grep -c '^<')"
        diff "$OUT/kv_digest_new.txt" "$OUT/kv_digest_parent.txt" | head -12
    else
        tail -3 "$OUT/kv_digest_new.txt"
    fi
fi
has kvbench && kv_bench_ab
if has kvnsub; then     # more warps a multiprocessor, each with half the tile in registers (#14)
    for n in 3 4 2; do
        sed -e "s/static constexpr int NSUB = DH <= 128 ? 2 : 1;/static constexpr int NSUB = 1;/" \
            -e "s/__launch_bounds__(128) strata_attention_decode_##FMT/__launch_bounds__(128, $n) strata_attention_decode_##FMT/" \
            cuda/kv_quant.cu > "/tmp/kv_nsub1_$n.cu" && build_fatbin "/tmp/kv_nsub1_$n.cu" "/tmp/kv_nsub1_$n.fatbin" &
    done
    wait
    nsub_bench="tools/kv_attention_bench.py --cells ${KV_CELLS:-32768,131072} --formats int8,q4_0,k8v4 --reps 30"
    echo "== kv attention bench, this build ($(elapsed) s)"
    timeout "$(budget 40)" $PY $nsub_bench 2>&1 | tail -6
    for n in 3 4 2; do
        echo "== kv attention bench, NSUB 1 at $n blocks a multiprocessor ($(elapsed) s)"
        [ -s "/tmp/kv_nsub1_$n.fatbin" ] && with_fatbin kv_quant "/tmp/kv_nsub1_$n.fatbin" \
            timeout "$(budget 40)" $PY $nsub_bench --blocks-per-sm $n 2>&1 | tail -6
    done
    echo "== test_kv_quant_gpu over NSUB 1 at 3 ($(elapsed) s)"
    [ -s /tmp/kv_nsub1_3.fatbin ] && with_fatbin kv_quant /tmp/kv_nsub1_3.fatbin \
        timeout "$(budget 90)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_kv_quant_gpu.py 2>&1 | tail -3
fi
if has kvring; then     # #14: NST tiles a warp in flight through shared memory against one in registers
    for arm in ring registers ring registers; do
        flag=(); [ $arm = registers ] && flag=(--registers)
        KV_CELLS=${KV_CELLS:-32768,131072} KV_FORMATS=${KV_FORMATS:-int8,k8v4,q4_0} kv_bench_once "$arm" "${flag[@]}"
    done
fi
if has kvring1; then    # #14: fewer, longer splits, each warp's ring deep
    n=${KV_RING_TILES:-2}
    sed -e "s/static constexpr int RING_FROM = 8 \* kWarps \* TILE;/static constexpr int RING_FROM = $n * kWarps * TILE;/" \
        cuda/kv_quant.cu >/tmp/kv_ring_from.cu
    if grep -q "RING_FROM = $n \* kWarps" /tmp/kv_ring_from.cu && build_fatbin /tmp/kv_ring_from.cu /tmp/kv_ring_from.fatbin; then
        for bps in 1 2; do
            for arm in ring registers; do
                flag=(--blocks-per-sm $bps); [ $arm = registers ] && flag+=(--registers)
                KV_CELLS=${KV_CELLS:-32768,65536} KV_FORMATS=${KV_FORMATS:-int8,k8v4,q4_0} \
                    with_fatbin kv_quant /tmp/kv_ring_from.fatbin kv_bench_once "$arm from $n tiles, $bps a multiprocessor" "${flag[@]}"
            done
        done
    else
        echo "kvring1: the RING_FROM line was not found or the variant did not build"
    fi
fi
if has ringmodel; then  # #14: the decode after 32K cells of q4_0 K/V with and without the ring
    for arm in ${RING_ARMS:-ring off ring}; do
        off=(); [ $arm = off ] && off=(--kernels-off kv-ring)
        bench "ringmodel_$arm" 120 $shape --kv q4_0 --prompt "${RING_PROMPT:-32768}" --decode 64 "${off[@]}"
    done
fi
if has kvncu; then      # is the quantized decode issue-bound? (#14: q4_0 at a quarter of the copy rate)
    ncu_kv "this build" tree
    [ -n "${KV_PARENT:-}" ] && with_parent kv_quant "$KV_PARENT" ncu_kv "$KV_PARENT" parent
fi
if has tcbench; then
    echo "== attention_tc bench, 80B shape ($(elapsed) s)"
    timeout "$(budget 60)" $PY tools/attention_tc_bench.py --shape 80b 2>&1 | tail -14
fi
if has kvres; then      # the VRAM window over host K/V against all K/V in VRAM: the same logits sha256
    bench kvres12 100 qwen3-30b-a3b-mtp --vram-budget-gib 12 --kv q4_0 --kv-resident 4096 --prompt 16384 --decode 64
    bench kvall12 100 qwen3-30b-a3b-mtp --vram-budget-gib 12 --kv q4_0 --prompt 16384 --decode 64
fi
if has prefill; then    # the prompt plan: the cost model's choice against the two fixed rules (#18 item 4)
    secs=90             # the first arm may verify the freshly built pack's checksums
    for gib in ${PREFILL_GIBS:-8 12}; do
        for rule in ${PREFILL_RULES:-auto bytes slots}; do
            bench "prefill_${rule}_${gib}" "$secs" qwen3-30b-a3b-mtp --vram-budget-gib "$gib" --prefill-rule "$rule" \
                --prompt 4096,16384,32768 --decode 0
            secs=32
        done
    done
fi
if has split; then      # the host's share of a short prompt's missed experts (--cpu-experts, #18)
    for mode in off auto; do
        bench "split_$mode" 80 qwen3-30b-a3b-mtp --vram-budget-gib 8 --prompt 19,64,512 --decode 32 --cpu-experts "$mode"
    done
fi
if has p2048; then      # #18's 12 GiB targets: 512 and 2048 tokens, the split off and on
    for mode in off auto; do
        bench "p2048_$mode" 60 qwen3-30b-a3b-mtp --vram-budget-gib 12 --prompt 512,2048 --decode 32 --cpu-experts "$mode"
    done
fi
has ttft && ttft_serve "$shape"
if has share; then      # a shared prompt prefix copied between parallel slots against read again (#19)
    pack=$(PYTHONPATH=/tmp/strata-pack-site $PY -c "from strata.synthetic import synthetic_pack; print(synthetic_pack('qwen3-30b-a3b-mtp', progress=False))")
    for gib in 0 12; do
        echo "== slot share, budget $gib GiB ($(elapsed) s)"
        timeout "$(budget 90)" $PY tools/slot_share_bench.py "$pack" --device cuda --vram-budget-gib "$gib" \
            --parallel 2 --prefix 8192 --rounds 2 --max-context 16384 --json "$OUT/share_$gib.json" 2>&1 | tail -3
    done
fi
if has layers; then     # a layer split over two cards against one card (#21)
    pair=0,1
    [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && pair=0,0
    bench layers_split 120 qwen3-30b-a3b-mtp --gpus "$pair" --vram-budget-gib 8,8 --prompt 4096 --decode 64
    bench layers_one16 90 qwen3-30b-a3b-mtp --vram-budget-gib 16 --prompt 4096 --decode 64
    bench layers_one8 90 qwen3-30b-a3b-mtp --vram-budget-gib 8 --prompt 4096 --decode 64
fi
if has dsplit; then     # decode misses on the host's cores against read in place (#18 item 3)
    # the forced arms last: the host's every miss may be slow, and their tracebacks show where (SIGABRT)
    for arm in "off 0 45" "auto 0 45" "off 25 45" "auto 25 50" "1 25 90" "1 0 80"; do
        set -- $arm
        bench "dsplit_$1_$2" "$3" qwen3-30b-a3b-mtp --vram-budget-gib 8 --prompt 19 --decode 32 --cpu-experts "$1" \
            --pcie-gbs "$2"
    done
fi
if has p2048cap; then   # the same at a PCIe 4.0 slot's rate
    for mode in off auto; do
        bench "p2048cap_$mode" 60 qwen3-30b-a3b-mtp --vram-budget-gib 12 --prompt 512,2048 --decode 32 \
            --cpu-experts "$mode" --pcie-gbs 25
    done
fi
if has splitcap; then   # the same at a PCIe 4.0 slot's rate (the cap only delays: logits as uncapped)
    for mode in off auto; do
        bench "splitcap_$mode" 80 qwen3-30b-a3b-mtp --vram-budget-gib 8 --prompt 19,64,512 --decode 32 \
            --cpu-experts "$mode" --pcie-gbs 25
    done
fi
if has batchres; then   # aggregate decode at 1..8 clients, every weight in VRAM (#19's must-show)
    echo "== parallel bench resident ($(elapsed) s)"
    timeout "$(budget 180)" $PY tools/parallel_bench.py --synthetic qwen3-30b-a3b-mtp --budget-gib 0 --batch-max 0 \
        --clients 1,2,4,8 --warm 16 --long 0 --json "$OUT/batch_res.json" 2>&1 | tail -20
fi
if has ttft12; then     # a short request beside a streamed long prompt (#19)
    echo "== short beside a streamed prompt, 12 GiB ($(elapsed) s)"
    timeout "$(budget 150)" $PY tools/parallel_bench.py --synthetic qwen3-30b-a3b-mtp --budget-gib 12 --clients 1 \
        --warm 4 --decode 16 --long 16384 --long-chunk auto --json "$OUT/ttft12.json" 2>&1 | tail -3
fi
if has batch; then      # --batch-max's auto rule against rows in line at 12 GiB (#19)
    echo "== parallel bench ($(elapsed) s)"
    timeout "$(budget 150)" $PY tools/parallel_bench.py --synthetic qwen3-30b-a3b-mtp --budget-gib 12 --batch-max 0,1 \
        --clients 1,4 --warm 16 --long 0 --json "$OUT/batch_ab.json" 2>&1 | tail -20
fi
has ncu && ncu_moe_decode
echo "== done at $(elapsed) s"
