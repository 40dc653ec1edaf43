#!/usr/bin/env bash
# A CUDA compiler from NVIDIA's pip wheels, for build machines without a toolkit (cibuildwheel's
# manylinux containers): installs into PREFIX and prints the CUDA_HOME to use (PREFIX/nvidia/cu13).
#   bash ci/install_nvcc.sh /opt/nvcc   ->   /opt/nvcc/nvidia/cu13
# 13.0 on purpose: the PTX in the fatbins is JIT-compiled by the user's driver, which must be at
# least as new as the nvcc that wrote it, so the oldest CUDA 13 nvcc reaches the most drivers.
set -euo pipefail
prefix="${1:?usage: install_nvcc.sh PREFIX}"
python="${PYTHON:-python3}"
"$python" -m pip install -q --disable-pip-version-check --target "$prefix" \
  "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" \
  "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" >&2
home="$prefix/nvidia/cu13"
[ -x "$home/bin/nvcc" ] || { echo "install_nvcc: $home/bin/nvcc missing after pip install" >&2; exit 1; }
# nvcc.profile looks for headers and libraries under targets/<target>-linux, which the wheels lack
case "$(uname -m)" in
  x86_64) target=x86_64-linux ;;
  aarch64) target=sbsa-linux ;;
  *) echo "install_nvcc: no CUDA target for $(uname -m)" >&2; exit 1 ;;
esac
mkdir -p "$home/targets/$target"
ln -sfn ../../include "$home/targets/$target/include"
ln -sfn ../../lib "$home/targets/$target/lib"
"$home/bin/nvcc" --version | tail -n 2 >&2
echo "$home"
