#!/usr/bin/env bash
# A new user's first hour on the GPU machine, in one device call, inside a deadline:
#
#   tools/first_hour_check.sh [steps...]       default: fresh tests first bench long
#     fresh   a fresh venv, README's `pip install .` (offline: wheels carried in .whl/ stand in for the
#             package index; the image's own packages are visible at the lowest priority), then
#             `python -m strata info --system` and a short `generate` on the demo, from outside the tree
#     first   tools/first_request.py: the first 19-token chat turn against the next ones, warm-up on/off
#     tests   tools/device_check.sh on TESTS (default: the kernels, the GPU runner and the GGUF presets)
#     bench   `python -m strata bench` with its defaults on the demo and on --synthetic tiny (exit codes)
#     long    `serve` on the synthetic qwen3-30b-a3b pack (trained for 40,960 tokens) at an 8 GiB budget
#             with the default context, and one 13K-token completion through the HTTP API
# DEADLINE_S (default 580) bounds the whole run; logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/strata-first-hour}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-580}
. tools/device_deadline.sh
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(fresh tests first bench long)
declare -A rc

has long && start_pack qwen3-30b-a3b 300

if has fresh; then
    echo "== fresh venv + pip install . ($(elapsed) s)"
    rm -rf /tmp/fresh && $PY -m venv /tmp/fresh || $PY -m venv --without-pip /tmp/fresh
    image_site=$($PY -c "import site; print(site.getsitepackages()[0])")
    fresh_site=$(/tmp/fresh/bin/python -c "import site; print(site.getsitepackages()[0])")
    echo "$image_site" >"$fresh_site/zz_image_packages.pth"     # last on sys.path: the image's packages
    t0=$(date +%s)
    PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl $PWD/.whl/build" timeout "$(budget 300)" /tmp/fresh/bin/python -m pip install . \
        >"$OUT/fresh_install.log" 2>&1
    rc[fresh_install]=$?
    echo "pip install . rc=${rc[fresh_install]} in $(( $(date +%s) - t0 )) s"
    grep -i "strata build" "$OUT/fresh_install.log" | tail -5
    [ "${rc[fresh_install]}" -ne 0 ] && tail -20 "$OUT/fresh_install.log"
    ( cd /tmp && /tmp/fresh/bin/python -c "import cuda.bindings, strata, sys; print('cuda.bindings', cuda.bindings.__version__, 'from', cuda.bindings.__file__); print('strata from', strata.__file__)"
      /tmp/fresh/bin/python -m strata info --system; echo "info --system rc=$?"
      timeout "$(budget 120)" /tmp/fresh/bin/python -m strata generate -p "def fibonacci(n):" -n 24; echo "generate rc=$?" ) \
        2>&1 | tee "$OUT/fresh_run.log"
fi

if has tests; then
    TESTS=${TESTS:-"tests/kernels tests/engine/test_cuda_runner.py tests/engine/test_gguf_presets.py tests/engine/test_context_gpu.py tests/engine/test_cuda_warm_up.py"}
    echo "== GPU tests ($(elapsed) s): $TESTS"
    OUT=$OUT timeout "$(budget 330)" bash tools/device_check.sh $TESTS 2>&1 | tee "$OUT/tests.log" | tail -40
    rc[tests]=${PIPESTATUS[0]}
    $PY - "$OUT/junit.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    if bad is not None:
        msg = (bad.get("message") or "").splitlines()
        print(f"FAILED {case.get('classname')}::{case.get('name')}: {msg[0][:300] if msg else ''}")
EOF
else
    OUT=$OUT timeout "$(budget 120)" bash tools/device_check.sh tests/kernels/test_runtime.py >"$OUT/build_only.log" 2>&1
fi
export PYTHONPATH=/tmp/strata-site${PYTHONPATH:+:$PYTHONPATH}

if has first; then
    echo "== first request, warm-up on and off ($(elapsed) s)"
    timeout "$(budget 120)" $PY tools/first_request.py --device cuda --json "$OUT/first.json" 2>&1 | tee "$OUT/first.log"
    rc[first]=${PIPESTATUS[0]}
fi

if has bench; then
    for what in "" "--synthetic tiny"; do
        name=bench_${what:+tiny}; name=${name%_}
        echo "== python -m strata bench $what ($(elapsed) s)"
        timeout "$(budget 120)" $PY -m strata bench $what --device cuda 2>"$OUT/$name.err" | tee "$OUT/$name.log"
        rc[$name]=${PIPESTATUS[0]}
        echo "exit ${rc[$name]}"; grep -i -E "note|clip|error" "$OUT/$name.err" | tail -5
    done
fi

if has long; then
    wait $pack_pid; cat "$OUT/pack.log"
    pack=$(tail -2 "$OUT/pack.log" | head -1)
    echo "== serve $pack --vram-budget-gib 8, one 13K-token completion ($(elapsed) s)"
    $PY -m strata serve "$pack" --device cuda --vram-budget-gib 8 --port 8093 >"$OUT/serve.log" 2>&1 &
    serve_pid=$!
    timeout "$(budget 200)" $PY tools/long_prompt_client.py --port 8093 --tokens 13000 --pack "$pack" \
        --server-pid $serve_pid 2>&1 | tee "$OUT/long.log"
    rc[long]=${PIPESTATUS[0]}
    kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null
    grep -E "^strata" "$OUT/serve.log" | head -5
    [ "${rc[long]}" -ne 0 ] && tail -25 "$OUT/serve.log"
fi

echo "== summary ($(elapsed) s)"
for k in "${!rc[@]}"; do echo "$k rc=${rc[$k]}"; done | sort
# the device tool brings back at most 8 files: the logs travel as one archive
( cd "$OUT" && tar czf /tmp/logs.tgz . && find . -type f ! -name '*.json' -delete && mv /tmp/logs.tgz . )
