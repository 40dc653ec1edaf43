#!/usr/bin/env bash
# The decode GEMVs' fatbins (cuda/gemv.cu, cuda/decode_fused.cu) of this tree and of an earlier commit,
# for an A/B with no package build on the GPU machine (tools/gemv_rows_ab.py; or the gemvab step of
# tools/decode_device_check.sh with GEMV_ARMS="parent:.whl/gemv_parent.fatbin:.whl/decode_fused_parent.fatbin").
#
#   tools/variants/make_gemv_parent.sh [COMMIT]   (default HEAD^)
#       -> .whl/{gemv,decode_fused}_{tree,parent}.fatbin (sm_90)
#   python3 tools/gemv_rows_ab.py --arm parent:.whl/gemv_parent.fatbin:.whl/decode_fused_parent.fatbin \
#       --arm tree:.whl/gemv_tree.fatbin:.whl/decode_fused_tree.fatbin
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=${1:-HEAD^}
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive "$commit" cuda | tar -x -C "$tmp"
for lib in gemv decode_fused; do
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -Icuda -o ".whl/${lib}_tree.fatbin" "cuda/$lib.cu" &
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -I"$tmp/cuda" -o ".whl/${lib}_parent.fatbin" "$tmp/cuda/$lib.cu" &
done
wait
ls -l .whl/gemv_{tree,parent}.fatbin .whl/decode_fused_{tree,parent}.fatbin
