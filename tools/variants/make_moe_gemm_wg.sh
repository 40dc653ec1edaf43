#!/usr/bin/env bash
# The prompt GEMM on Hopper's wgmma (cuda/moe_gemm_wg.cu, #17) beside this tree's mma.sync build
# (cuda/moe_gemm.cu), as fatbins for tools/moe_gemm_wg_ab.py: no package build on the GPU machine.
# The _swap build exchanges the shared-memory descriptors' two byte offsets (STRATA_WG_SWAP_LBO=1),
# in case the hardware reads the no-swizzle layout's offsets the other way round from the PTX
# manual's reading; the checks tell which of the two is right.
#
#   tools/variants/make_moe_gemm_wg.sh   -> .whl/moe_gemm_{mma,wg,wg_swap}.fatbin   (about a minute)
#
# Then on the GPU machine, .whl carried (about a minute, most of it making random weights):
#   python3 tools/moe_gemm_wg_ab.py --arm mma:.whl/moe_gemm_mma.fatbin:strata_moe_gemm \
#       --arm wg:.whl/moe_gemm_wg.fatbin:strata_moe_gemm_wg --arm swap:.whl/moe_gemm_wg_swap.fatbin:strata_moe_gemm_wg
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -Icuda -o .whl/moe_gemm_mma.fatbin cuda/moe_gemm.cu &
nvcc -fatbin -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda -o .whl/moe_gemm_wg.fatbin cuda/moe_gemm_wg.cu &
nvcc -fatbin -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda -DSTRATA_WG_SWAP_LBO=1 \
    -o .whl/moe_gemm_wg_swap.fatbin cuda/moe_gemm_wg.cu &
wait
ls -l .whl/moe_gemm_mma.fatbin .whl/moe_gemm_wg.fatbin .whl/moe_gemm_wg_swap.fatbin
