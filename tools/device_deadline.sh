# Sourced by the device scripts that run inside a deadline (tools/stream_device_check.sh,
# tools/decode_graph_check.sh): needs PY, OUT, DEADLINE_S and T0 (date +%s at the start) set, or
# device_setup to set them.
#
#   device_setup NAME [STEP...]
#                            the step-driven scripts' start: OUT (default /tmp/strata-NAME) made,
#                            PY, PYTHONUNBUFFERED and STRATA_CUDA_ARCHS (default 90) exported, T0 now,
#                            DEADLINE_S (default 570); steps = the script's arguments (SCRIPT_ARGS),
#                            or the STEPs given when there are none; with BUNDLE=1, at exit every
#                            file of $OUT but build.log goes into $OUT/all.tgz (the device tool
#                            returns 8 files)
#   has STEP                 whether STEP is among the script's steps (the array `steps`)
#   elapsed                  seconds since T0
#   budget SECONDS           SECONDS, or what is left of DEADLINE_S if that is less
#   start_pack SHAPE SECS    build the synthetic pack SHAPE in the background (its log: $OUT/pack.log,
#                            its pid: $pack_pid), with numpy and gguf from .whl/ in a site dir of its
#                            own, so device_check's installs are untouched
#   device_tests SECS TAIL [pytest paths...]
#                            tools/device_check.sh over the paths, its last TAIL lines shown (without
#                            paths: the build and test_runtime.py alone); then the tests' site dir on
#                            PYTHONPATH, the script's during_pack function if it defines one, and
#                            start_pack's pack waited for
#   with_parent LIB PARENT_CU CMD...
#                            CMD run with strata/kernels/LIB.fatbin built from PARENT_CU (an earlier
#                            cuda/LIB.cu carried in .whl/) and the manifest's sha256 patched to it; this
#                            build's fatbin and manifest are put back after (the A/B of one library);
#                            built once for the parent and cuda/*.cuh as they are, then reused
#   with_fatbin LIB FATBIN CMD...
#                            the same with a fatbin built already (build_fatbin SRC OUT [flags]: nvcc's
#                            fatbin of SRC for sm_90)
#   kv_bench_ab              tools/kv_attention_bench.py --cells ${KV_CELLS:-16384,32768,131072}; with
#                            KV_PARENT (an earlier cuda/kv_quant.cu) also over that one, then this
#                            build again: the quantized decode attention's A/B in one call
#   ncu_moe_decode           Nsight Compute (clocks left alone) over tools/moe_decode_bench.py: the MoE
#                            decode kernels' speed of light, memory workload, warp stalls and occupancy
#                            (NCU_TYPES, default Q4_K; 1 and 4 tokens); the report in $OUT/ncu.csv
#   ncu_kv LABEL TAG         Nsight Compute over the quantized split-K decode attention (int8 and q4_0,
#                            Dh 128, 32K cells, tools/kv_attention_bench.py): time, DRAM throughput,
#                            executed instructions, issue slots, eligible warps (is it issue-bound?);
#                            each report in $OUT/ncu_kv_<fmt>_TAG.csv
#   ttft_serve SHAPE         tools/ttft_server.py: `strata serve` on SHAPE's synthetic pack at 8 GiB, six
#                            short chat turns' time to first token (#18); its log in $OUT/ttft.log
#   moe_decode_ab            tools/moe_decode_bench.py (MOE_TYPES, default Q4_K,Q6_K,Q8_0; 1 and 4
#                            tokens; blocks per SM 2,3,4) on each .cu of MOE_VARIANTS (cuda/moe_decode.cu
#                            itself, variants of it carried in .whl/), each with ptxas's registers and
#                            spills of its kernels of those types
#   bench_synthetic NAME SECS SHAPE [bench args...]
#                            `strata bench --synthetic SHAPE --device cuda`, JSON and log under $OUT
#                            (BENCH_LINES: an egrep pattern of the lines to show, default all)

device_setup() {
    local name=$1; shift
    OUT=${OUT:-/tmp/strata-$name}
    mkdir -p "$OUT"
    PY=${PYTHON:-python3}
    export PYTHONUNBUFFERED=1 STRATA_CUDA_ARCHS=${STRATA_CUDA_ARCHS:-90}
    T0=$(date +%s)
    DEADLINE_S=${DEADLINE_S:-570}
    steps=("${SCRIPT_ARGS[@]}")
    [ ${#steps[@]} -eq 0 ] && steps=("$@")
    # the device tool returns at most 8 files of $OUT: BUNDLE=1 leaves one, every log in it
    [ "${BUNDLE:-0}" = 1 ] && trap 'bundle_out' EXIT
    return 0
}

bundle_out() {
    local tmp
    tmp=$(mktemp -d) && mv "$OUT"/* "$tmp"/ 2>/dev/null
    tar czf "$OUT/all.tgz" --exclude=build.log -C "$tmp" . && rm -rf "$tmp"
    echo "== $OUT/all.tgz: $(tar tzf "$OUT/all.tgz" | grep -vc '/$') files"
}
has() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
elapsed() { echo $(( $(date +%s) - T0 )); }
# at least 1: `timeout 0` would mean no limit at all (a step reached after the deadline ran unbounded)
budget() { local left=$(( DEADLINE_S - $(elapsed) )); [ "$left" -lt 1 ] && left=1; [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }

start_pack() {
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/strata-pack-site \
        $(ls .whl/*.whl 2>/dev/null | grep -v '/nvidia_') >/dev/null 2>&1
    ( PYTHONPATH=/tmp/strata-pack-site timeout "$(budget "$2")" $PY -c \
        "from strata.synthetic import synthetic_pack; print(synthetic_pack('$1', progress=False))"
      echo "pack rc=$? at $(elapsed) s" ) >"$OUT/pack.log" 2>&1 &
    pack_pid=$!
}

device_tests() {
    local secs=$1 lines=$2; shift 2
    if [ $# -gt 0 ]; then
        OUT=$OUT timeout "$(budget "$secs")" bash tools/device_check.sh "$@" 2>&1 | tee "$OUT/tests.log" | tail -"$lines"
    else
        OUT=$OUT timeout "$(budget "$secs")" bash tools/device_check.sh tests/kernels/test_runtime.py 2>&1 | tail -3
    fi
    export PYTHONPATH=/tmp/strata-site${PYTHONPATH:+:$PYTHONPATH}
    # the scripts' own pytest calls: pyproject's addopts (-n auto) need pytest-xdist (device_check.sh says so)
    $PY -c "import xdist" 2>/dev/null || export PYTEST_ADDOPTS="-o addopts= ${PYTEST_ADDOPTS:-}"
    if declare -F during_pack >/dev/null; then during_pack; fi     # the script's GPU work that needs no pack
    [ -n "${pack_pid:-}" ] && wait "$pack_pid"
    cat "$OUT/pack.log"
}

bench_synthetic() {
    local name=$1 secs=$2 shape=$3; shift 3
    echo "== bench $name: $shape $* ($(elapsed) s)"
    # SIGABRT at the deadline: with PYTHONFAULTHANDLER every thread's Python stack goes to the .err
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 5 "$(budget "$secs")" $PY -m strata bench --synthetic "$shape" --device cuda \
        --json "$OUT/$name.json" "$@" 2>"$OUT/$name.err" | tee "$OUT/$name.log" | grep -E "${BENCH_LINES:-.}"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        if grep -q "most recent call first" "$OUT/$name.err"; then
            echo "-- $name ran past its ${secs} s; where its threads were:"
            grep -E "^(Thread|Current thread)|File .*strata" "$OUT/$name.err" | head -30
        else
            tail -5 "$OUT/$name.err"
        fi
    fi
}

with_parent() {         # the parent's fatbin is built once a run (a minute for kv_quant.cu), then reused
    local lib=$1 parent=$2 out; shift 2
    out="/tmp/$lib.$(basename "$parent" .cu).$(cat "$parent" cuda/*.cuh | cksum | cut -d' ' -f1).fatbin"
    [ -s "$out" ] || build_fatbin "$parent" "$out" || { rm -f "$out"; return 1; }
    with_fatbin "$lib" "$out" "$@"
}

build_fatbin() {        # build_fatbin SRC OUT [nvcc flags...]: SRC (a cuda/*.cu or a variant of one) for the H200
    local src=$1 out=$2; shift 2
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -Icuda "$@" -o "$out" "$src"
}

with_fatbin() {         # with_fatbin LIB FATBIN CMD...: CMD with strata/kernels/LIB.fatbin replaced by FATBIN (nests:
                        # each level keeps its own copy of the manifest to put back)
    local lib=$1 fatbin=$2 kdir=strata/kernels rc; shift 2
    cp "$kdir/$lib.fatbin" "/tmp/$lib.new.fatbin" && cp "$kdir/manifest.json" "/tmp/manifest.$lib.json" || return 1
    cp "$fatbin" "$kdir/$lib.fatbin" || return 1
    $PY -c "import hashlib, json; p='$kdir/manifest.json'; m=json.load(open(p)); e=m['kernels']['$lib']; \
e['sha256']=hashlib.sha256(open('$kdir/'+e['file'],'rb').read()).hexdigest(); json.dump(m, open(p,'w'))"
    "$@"
    rc=$?
    cp "/tmp/$lib.new.fatbin" "$kdir/$lib.fatbin" && cp "/tmp/manifest.$lib.json" "$kdir/manifest.json"
    return $rc
}

kv_bench_once() {      # kv_bench_once LABEL [bench args...]
    local label=$1; shift
    echo "== kv attention bench, $label ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/kv_attention_bench.py --cells "${KV_CELLS:-16384,32768,131072}" \
        --formats "${KV_FORMATS:-f16,f16tc,int8,k8v4,q4_0}" "$@" 2>&1 | tail -16
}

kv_bench_ab() {
    kv_bench_once "this build"
    if [ -n "${KV_PARENT:-}" ]; then
        with_parent kv_quant "$KV_PARENT" kv_bench_once "$KV_PARENT"
        kv_bench_once "this build, again"
    fi
}

ncu_moe_decode() {
    echo "== ncu: the MoE decode kernels ($(elapsed) s)"
    timeout "$(budget 150)" ncu --clock-control none --target-processes all --graph-profiling node \
        --kernel-name regex:strata_moe_ --launch-skip 20 --launch-count 8 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
        --csv --page details $PY tools/moe_decode_bench.py --types "${NCU_TYPES:-Q4_K}" --tokens 1,4 \
        --blocks-per-sm 2 --reps 5 >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
    echo "ncu rc=$?"
    grep -E "Kernel Name|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp|Eligible|L1/TEX Hit|L2 Hit" \
        "$OUT/ncu.csv" | cut -c1-200 | head -70
    tail -3 "$OUT/ncu.err"
}

ncu_kv() {
    local fmt
    for fmt in int8 q4_0; do
        echo "== ncu: strata_attention_decode_${fmt}_d128, $1 ($(elapsed) s)"
        timeout "$(budget 90)" ncu --clock-control none --kernel-name "regex:strata_attention_decode_${fmt}_d128" \
            --launch-skip 3 --launch-count 1 --section SpeedOfLight --section InstructionStats \
            --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
            --csv --page details $PY tools/kv_attention_bench.py --cells 32768 --formats "$fmt" --reps 5 \
            >"$OUT/ncu_kv_${fmt}_$2.csv" 2>"$OUT/ncu_kv_$2.err"
        echo "ncu rc=$?"
        local keys="Duration|DRAM Throughput|Compute \(SM\) Throughput|Executed Ipc Active|Issue Slots Busy"
        keys+="|Executed Instructions|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Eligible"
        grep -E "$keys" "$OUT/ncu_kv_${fmt}_$2.csv" | cut -c1-200 | head -16
    done
    tail -3 "$OUT/ncu_kv_$2.err"
}

ttft_serve() {
    echo "== ttft through serve, 8 GiB ($(elapsed) s)"
    local pack
    pack=$(PYTHONPATH=/tmp/strata-pack-site $PY -c "from strata.synthetic import synthetic_pack; print(synthetic_pack('$1', progress=False))")
    timeout "$(budget 120)" $PY tools/ttft_server.py "$pack" --device cuda --turns 6 --words "${TTFT_WORDS:-4}" \
        --serve-arg=--vram-budget-gib=8 --ready-timeout 100 --json "$OUT/ttft.json" >"$OUT/ttft.log" 2>&1
    tail -12 "$OUT/ttft.log"
}

moe_decode_ab() {
    local v bench=(tools/moe_decode_bench.py --types "${MOE_TYPES:-Q4_K,Q6_K,Q8_0}" --tokens 1,4 --blocks-per-sm 2,3,4 --digest)
    for v in ${MOE_VARIANTS:-}; do
        echo "== moe_decode bench, $v ($(elapsed) s)"
        build_fatbin "$v" /tmp/moe_variant.fatbin -Xptxas -v 2>/tmp/moe_variant.ptxas \
            || { tail -5 /tmp/moe_variant.ptxas; continue; }
        grep -A4 -E "Compiling entry.*(gate_up|down)_(q4_k|q6_k|q8_0)" /tmp/moe_variant.ptxas \
            | grep -oE "(entry function '[a-z_0-9]+|Used [0-9]+ registers|[0-9]+ bytes spill stores)" | paste -sd' '
        with_fatbin moe_decode /tmp/moe_variant.fatbin timeout "$(budget 60)" $PY "${bench[@]}" 2>&1 | tail -20
    done
}
