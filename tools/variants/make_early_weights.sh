#!/usr/bin/env bash
# The one-row decode GEMVs (strata_gemv_one_*, strata_gemv3_one_*) asking for their first row's weights before
# their PDL wait (pdl.cuh's STRATA_PDL_EARLY, gemv_rows.cuh's early_row; #16): fatbins of cuda/gemv.cu and
# cuda/decode_fused.cu built with STRATA_EARLY_WEIGHTS=1 (into the L2) and =2 (into the L1), sm_90, for
# tools/decode_device_check.sh's `early` step (no package build on the GPU machine for the arms).
#
#   tools/variants/make_early_weights.sh   -> .whl/{gemv,decode_fused}_early{1,2}.fatbin
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
for mode in 1 2; do
    for lib in gemv decode_fused; do
        nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -Icuda -DSTRATA_EARLY_WEIGHTS=$mode -o ".whl/${lib}_early$mode.fatbin" \
            "cuda/$lib.cu" &
    done
done
wait
ls -l .whl/{gemv,decode_fused}_early{1,2}.fatbin
