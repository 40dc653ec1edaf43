#!/usr/bin/env bash
# The staged-x variant of the decode GEMVs (#19, #16), to be measured before it replaces them: the
# one-token strata_gemv_*, strata_gemv_split_*, strata_gemv3_* and the row-invariant strata_gemv_rows_*,
# strata_gemv_rows_split_*, strata_gemv3_rows_* (cuda/gemv.cu, cuda/decode_fused.cu) of the
# one-block-per-unit types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) read each token's x from a tile in
# shared memory (padded 4 floats per 32-weight block; 18 KB static for one token, 36 KB for batches)
# instead of global memory, where each warp load of x touched 32 cache lines, once per token. The sums
# are the global path's, in its order (gemv_rows_staged.patch). ptxas (sm_90, nvcc 13.0), Q8_0
# registers: gemv 79 (80 before), gemv_split 96 (80), gemv3 121 (128), rows 155 (161), rows_split 158
# (160), gemv3_rows 163 (160); no spills.
#
#   tools/variants/make_gemv_staged.sh     -> .whl/{gemv,decode_fused}_{tree,staged}.fatbin
#
# Then, with no package build on the GPU machine (about 30 s; .whl carried): this build's fatbins
# (.whl/gemv_tree.fatbin and .whl/decode_fused_tree.fatbin, made here too) against the variant's,
#       python3 tools/gemv_rows_ab.py --arm tree:.whl/gemv_tree.fatbin:.whl/decode_fused_tree.fatbin \
#           --arm staged:.whl/gemv_staged.fatbin:.whl/decode_fused_staged.fatbin
# and, over a build, GEMV_ARM_TESTS=1 GEMV_ARMS="staged:.whl/gemv_staged.fatbin:.whl/decode_fused_staged.fatbin"
#       tools/decode_device_check.sh gemvab   (the row-invariance tests, the 4-row step's kernel table
#       and 1 and 4 clients over the variant, then this build)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
tmp=$(mktemp -d)
cp cuda/*.cu cuda/*.cuh "$tmp"/
patch -s -d "$tmp" -p2 < tools/variants/gemv_rows_staged.patch
for lib in gemv decode_fused; do
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -Icuda -o ".whl/${lib}_tree.fatbin" "cuda/$lib.cu" &
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -I"$tmp" -o ".whl/${lib}_staged.fatbin" "$tmp/$lib.cu" &
done
wait
rm -rf "$tmp"
ls -l .whl/gemv_{tree,staged}.fatbin .whl/decode_fused_{tree,staged}.fatbin
