#!/usr/bin/env bash
# A change against its parent in one device call (the method's "compare a change against its parent
# in one call"): the parent's tree, carried as BASE (a `git archive` of it, ignored here), is built
# beside this one while this one builds and runs its GPU tests; then tools/stream_check.py runs in
# both on the synthetic qwen3-30b-a3b: logits sha256 of a PROMPT-token prompt and 64 greedy tokens,
# resident and at BUDGET GiB, with the prompt and decode speeds of each. Extra steps follow.
#
#   git archive PARENT -- . ':!strata/demo' | (mkdir -p ab_base && tar -x -C ab_base)   # here, once
#   tools/ab_device_check.sh [steps...]          steps: tests ab pcie kv (default: tests ab pcie)
#     tests   build + GPU tests of this tree (TESTS overrides the pytest paths)
#     ab      stream_check.py in the parent's tree and in this one
#     pcie    bench at 12 GiB, prompts 512 and 2048, with and without --pcie-gbs 25
#     kv      tools/kv_attention_bench.py, and the bench at 12 GiB with --kv q4_0 and int8
# BASE (default ab_base), PROMPT (default 16384), DECODE (default 64), BUDGET (default 8), ORDER
# (default "base this": which tree runs first),
# DEADLINE_S (default 560). Logs go to LOGS (default /tmp/strata-ab-check); with OUT set (the
# device tool's folder, which returns at most 8 files) they come back as one OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
RETURN=${OUT:-}
OUT=${LOGS:-/tmp/strata-ab-check}
mkdir -p "$OUT"
trap '[ -n "$RETURN" ] && tar -czf "$RETURN/logs.tgz" -C "$OUT" . 2>/dev/null' EXIT
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 STRATA_CUDA_ARCHS=${STRATA_CUDA_ARCHS:-90}
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
BASE=${BASE:-ab_base} PROMPT=${PROMPT:-16384} DECODE=${DECODE:-64} BUDGET=${BUDGET:-8}
. tools/device_deadline.sh
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests ab pcie)

start_pack qwen3-30b-a3b 200
if has ab; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/strata-headers .whl/nvidia_*.whl >/dev/null 2>&1
    ( PYTHONPATH=/tmp/strata-headers timeout "$(budget 300)" $PY -m pip install -q --no-build-isolation --no-deps \
        --target /tmp/strata-base-site "./$BASE" >"$OUT/base_build.log" 2>&1; echo "base build rc=$? at $(elapsed) s" \
        >>"$OUT/base_build.log" ) &
    base_pid=$!
fi
TESTS=${TESTS:-tests/kernels}
if has tests; then
    OUT=$OUT timeout "$(budget 330)" bash tools/device_check.sh $TESTS 2>&1 | tee "$OUT/tests.log" | tail -30
else
    OUT=$OUT timeout "$(budget 150)" bash tools/device_check.sh tests/kernels/test_runtime.py 2>&1 | tail -3
fi
export PYTHONPATH=/tmp/strata-site${PYTHONPATH:+:$PYTHONPATH}
wait $pack_pid
cat "$OUT/pack.log"
if has ab; then
    wait $base_pid
    tail -2 "$OUT/base_build.log"
    for tree in ${ORDER:-base this}; do
        echo "== stream_check in the $tree tree ($(elapsed) s)"
        # the base's copy of the script runs from /tmp, so the path it puts first holds no strata
        if [ $tree = base ]; then site=/tmp/strata-base-site:$PYTHONPATH; script=/tmp/ab_check/tools/stream_check.py
            mkdir -p /tmp/ab_check/tools && cp "$BASE/tools/stream_check.py" $script
        else site=$PYTHONPATH; script=tools/stream_check.py; fi
        ( PYTHONPATH=$site timeout "$(budget 150)" $PY $script --prompt "$PROMPT" \
            --decode "$DECODE" --budget-gib "$BUDGET" --json "$OUT/ab_$tree.json" 2>"$OUT/ab_$tree.err" ) | tee "$OUT/ab_$tree.log"
        [ "${PIPESTATUS[0]}" -gt 1 ] && tail -6 "$OUT/ab_$tree.err"
        [ $tree = base ] && PYTHONPATH=/tmp/strata-base-site:$PYTHONPATH $PY -c "import strata; print('base tree:', strata.__file__)"
    done
fi
if has pcie; then
    for cap in 0 25; do
        echo "== bench at 12 GiB, --pcie-gbs $cap ($(elapsed) s)"
        timeout "$(budget 90)" $PY -m strata bench --synthetic qwen3-30b-a3b --device cuda --vram-budget-gib 12 \
            --pcie-gbs $cap --prompt 512,2048 --decode 32 --json "$OUT/pcie_$cap.json" 2>"$OUT/pcie_$cap.err" \
            | tee "$OUT/pcie_$cap.log"
        [ "${PIPESTATUS[0]}" -ne 0 ] && tail -5 "$OUT/pcie_$cap.err"
    done
fi
if has kv; then
    echo "== decode attention per KV format ($(elapsed) s)"
    timeout "$(budget 90)" $PY tools/kv_attention_bench.py --json "$OUT/kv_attn.json" 2>"$OUT/kv_attn.err" | tee "$OUT/kv_attn.log"
    [ "${PIPESTATUS[0]}" -ne 0 ] && tail -5 "$OUT/kv_attn.err"
    for kv in q4_0 int8; do
        echo "== bench at 12 GiB, --kv $kv ($(elapsed) s)"
        timeout "$(budget 90)" $PY -m strata bench --synthetic qwen3-30b-a3b --device cuda --vram-budget-gib 12 \
            --kv $kv --prompt 16384 --decode 64 --json "$OUT/kv_$kv.json" 2>"$OUT/kv_$kv.err" | tee "$OUT/kv_$kv.log"
        [ "${PIPESTATUS[0]}" -ne 0 ] && tail -5 "$OUT/kv_$kv.err"
    done
fi
echo "== done at $(elapsed) s"
