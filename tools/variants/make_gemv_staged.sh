#!/usr/bin/env bash
# The staged-x variant of the row-invariant batched GEMVs (#19, #16), to be measured before it replaces
# them: strata_gemv_rows_*, strata_gemv_rows_split_* (cuda/gemv.cu) and strata_gemv3_rows_*
# (cuda/decode_fused.cu) of the one-block-per-unit types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) read
# each token's x from a tile in shared memory (36 KB static, padded 4 floats per 32-weight block)
# instead of global memory, where each warp load of x touched 32 cache lines once per token. The sums
# are the global path's, in its order (gemv_rows_staged.patch). ptxas (sm_90, nvcc 13.0): Q8_0 rows
# 155 registers (161 before), rows_split 158 (160), gemv3_rows 163 (160), no spills.
#
#   tools/variants/make_gemv_staged.sh     -> .whl/gemv_staged.fatbin, .whl/decode_fused_staged.fatbin
#
# Then: GEMV_ARM_TESTS=1 GEMV_ARMS="staged:.whl/gemv_staged.fatbin:.whl/decode_fused_staged.fatbin"
#       tools/decode_device_check.sh gemvab   (the row-invariance tests, the 4-row step's kernel table
#       and 1 and 4 clients over the variant, then this build)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
tmp=$(mktemp -d)
cp cuda/*.cu cuda/*.cuh "$tmp"/
patch -s -d "$tmp" -p2 < tools/variants/gemv_rows_staged.patch
for lib in gemv decode_fused; do
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -I"$tmp" -o ".whl/${lib}_staged.fatbin" "$tmp/$lib.cu" &
done
wait
rm -rf "$tmp"
ls -l .whl/gemv_staged.fatbin .whl/decode_fused_staged.fatbin
