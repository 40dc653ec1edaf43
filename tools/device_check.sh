#!/usr/bin/env bash
# Build Strata's CUDA parts and run the GPU tests, in one device call; a summary table comes last.
#
#   tools/device_check.sh [--quant-report] [pytest paths...]        default: tests/kernels
#
# --quant-report also runs tools/quant_kernel_report.py (dequant exactness, GEMV error and GB/s of
# every quant type) and prints its table last.
#
# STRATA_CUDA_ARCHS narrows the fatbins (default here: 90, the H200); OUT is where logs go (the
# device tool's $OUT, else /tmp/strata-check). Wheels carried in .whl/ are used first: nvidia-* ones
# only for their headers during the build (cuda.h must be at least as new as cuda-bindings), the
# others (gguf, pytest-xdist, ...) on PYTHONPATH for the tests. pyproject's addopts ask for `-n auto`
# (none where a GPU is present: tests/conftest.py); without pytest-xdist here they are cleared
# (PYTEST_ADDOPTS="-o addopts=", exported for the device scripts' own pytest calls too).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/strata-check}
mkdir -p "$OUT"
export STRATA_CUDA_ARCHS=${STRATA_CUDA_ARCHS:-90} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
quant_report=0
[ "${1:-}" = "--quant-report" ] && { quant_report=1; shift; }
paths=("$@")
[ ${#paths[@]} -eq 0 ] && paths=(tests/kernels)

install_wheels() {  # install_wheels TARGET GLOB...
    local target=$1; shift
    local wheels=($(ls "$@" 2>/dev/null))
    [ ${#wheels[@]} -eq 0 ] && return 0
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$target" "${wheels[@]}"
}
install_wheels /tmp/strata-headers .whl/nvidia_*.whl || exit 1
install_wheels /tmp/strata-site $(ls .whl/*.whl 2>/dev/null | grep -v '/nvidia_') || exit 1

echo "== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import sys, cuda.bindings as b; print('python', sys.version.split()[0], '| cuda-bindings', b.__version__)"
nvcc --version | tail -2

echo "== build (STRATA_CUDA_ARCHS=$STRATA_CUDA_ARCHS)"
t0=$(date +%s%N)
PYTHONPATH=/tmp/strata-headers${PYTHONPATH:+:$PYTHONPATH} \
    $PY -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
build_rc=$?
build_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
grep "strata build:" "$OUT/build.log"
[ $build_rc -ne 0 ] && tail -40 "$OUT/build.log"

export PYTHONPATH=/tmp/strata-site${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import xdist" 2>/dev/null; then
    echo "== pytest-xdist not here (carry its wheel and execnet's in .whl): pyproject's addopts cleared"
    export PYTEST_ADDOPTS="-o addopts= ${PYTEST_ADDOPTS:-}"
fi
echo "== tests: ${paths[*]}"
$PY -m pytest "${paths[@]}" -q -rs --continue-on-collection-errors --junitxml="$OUT/junit.xml" 2>&1 \
    | tee "$OUT/pytest.log" | tail -40
test_rc=${PIPESTATUS[0]}

echo "== rms_norm timing"
$PY - <<'EOF' 2>&1 | tee "$OUT/timing.log"
import numpy as np
from strata._ext import runtime as rt
dev = rt.Device(0)
kernel = rt.load_library("rms_norm").kernel(dev, "strata_rms_norm_f32", "PPPiif")
stream = rt.Stream(dev)
for rows, n in [(16384, 2048), (16384, 4096), (1, 4096)]:
    x = np.random.default_rng().standard_normal((rows, n)).astype(np.float32)
    xb, yb, wb = rt.DeviceBuffer(dev, x.nbytes), rt.DeviceBuffer(dev, x.nbytes), rt.DeviceBuffer(dev, n * 4)
    xb.copy_from_host(x); wb.copy_from_host(x[0])
    events = [rt.Event(dev, timing=True) for _ in range(2)]
    times = []
    for _ in range(25):
        events[0].record(stream)
        kernel.launch(rows, 256, (xb, wb, yb, rows, n, 1e-6), stream=stream)
        events[1].record(stream)
        events[1].synchronize()
        times.append(events[0].elapsed_ms(events[1]))
    ms = float(np.median(times[5:]))
    print(f"rms_norm rows={rows} n={n}: {ms * 1e3:.1f} us, {2 * x.nbytes / ms / 1e6:.0f} GB/s")
EOF

echo "== summary"
$PY - "$OUT/junit.xml" "$build_rc" "$build_ms" "$test_rc" <<'EOF'
import sys, xml.etree.ElementTree as ET
from collections import defaultdict
path, build_rc, build_ms, test_rc = sys.argv[1:]
rows = defaultdict(lambda: [0, 0, 0, 0.0])
try:
    for case in ET.parse(path).iter("testcase"):
        row = rows[case.get("classname", "?")]
        kind = 1 if case.find("failure") is not None or case.find("error") is not None else 2 if case.find("skipped") is not None else 0
        row[kind] += 1
        row[3] += float(case.get("time", 0))
except (OSError, ET.ParseError) as exc:
    print(f"no junit results ({exc})")
print(f"{'what':<40} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}")
print(f"{'build (pip install -e .)':<40} {'ok' if build_rc == '0' else 'FAILED':>7} {'':>7} {'':>8} {int(build_ms) / 1000:>8.1f}")
for name, (ok, bad, skip, secs) in sorted(rows.items()):
    print(f"{name:<40} {ok:>7} {bad:>7} {skip:>8} {secs:>8.2f}")
print(f"pytest exit code {test_rc}")
EOF

report_rc=0
if [ $quant_report -eq 1 ]; then
    echo "== quant kernels: dequant exactness, GEMV error and GB/s"
    $PY tools/quant_kernel_report.py --json "$OUT/quant_kernels.json" 2>&1 | tee "$OUT/quant_kernels.log"
    report_rc=${PIPESTATUS[0]}
fi
exit $(( build_rc != 0 || test_rc != 0 || report_rc != 0 ))
