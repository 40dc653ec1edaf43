#!/usr/bin/env bash
# The prompt kernels on Hopper's wgmma (#17: cuda/moe_gemm_wg.cu, cuda/attention_wg.cu) beside this tree's
# mma.sync builds (cuda/moe_gemm.cu, cuda/attention_tc.cu), as fatbins for tools/moe_gemm_wg_ab.py and
# tools/attention_wg_ab.py: no package build on the GPU machine. The _swap builds exchange the shared-memory
# descriptors' two byte offsets (STRATA_WG_SWAP_LBO=1 for the K-major operands: the GEMM's W and X,
# attention's K; STRATA_WG_SWAP_MN=1 for attention's N-major V), in case the hardware reads the
# no-swizzle layout's offsets the other way round from the PTX manual's reading; the checks tell.
# attention_wg_pipe is attention_wg.cu with tools/variants/attention_wg_pipe.patch applied: S(tile + 1)
# issued before this tile's softmax so the two overlap (FlashAttention-3's intra-warpgroup pipelining;
# K double-buffered, 48 KB, 236 registers, no spills), an arm to measure beside the plain kernel.
#
#   tools/variants/make_wgmma.sh   -> .whl/moe_gemm_{mma,wg,wg_swap}.fatbin,
#                                     .whl/attention_{tc,wg,wg_swap_k,wg_swap_v,wg_swap_kv,wg_pipe}.fatbin
#
# Then on the GPU machine, .whl carried (a minute or two, most of it making random weights):
#   python3 tools/moe_gemm_wg_ab.py --arm mma:.whl/moe_gemm_mma.fatbin:strata_moe_gemm \
#       --arm wg:.whl/moe_gemm_wg.fatbin:strata_moe_gemm_wg --arm swap:.whl/moe_gemm_wg_swap.fatbin:strata_moe_gemm_wg
#   python3 tools/attention_wg_ab.py --arm tc:.whl/attention_tc.fatbin:strata_attention_prefill_tc_f16 \
#       --arm wg:.whl/attention_wg.fatbin:strata_attention_prefill_wg_f16 \
#       --arm swap_k:.whl/attention_wg_swap_k.fatbin:strata_attention_prefill_wg_f16 \
#       --arm swap_v:.whl/attention_wg_swap_v.fatbin:strata_attention_prefill_wg_f16 \
#       --arm swap_kv:.whl/attention_wg_swap_kv.fatbin:strata_attention_prefill_wg_f16 \
#       --arm pipe:.whl/attention_wg_pipe.fatbin:strata_attention_prefill_wg_f16
# (tools/nobuild_ab.sh runs these, each wgmma arm's checks in a process of its own.)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
SM90="-arch=sm_90"
SM90A="-gencode=arch=compute_90a,code=sm_90a"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp cuda/*.cu cuda/*.cuh "$tmp"/
patch -s -d "$tmp" -p2 < tools/variants/attention_wg_pipe.patch
build() {   # build OUT ARCH SRC [flags...]: SRC cuda/<SRC>.cu, or a path
    local out=$1 arch=$2 src=$3; shift 3
    [ -f "$src" ] || src="cuda/$src.cu"
    nvcc -fatbin -O3 -std=c++17 $arch -I"$(dirname "$src")" "$@" -o ".whl/$out.fatbin" "$src"
}
build moe_gemm_mma "$SM90" moe_gemm &
build moe_gemm_wg "$SM90A" moe_gemm_wg &
build moe_gemm_wg_swap "$SM90A" moe_gemm_wg -DSTRATA_WG_SWAP_LBO=1 &
build attention_tc "$SM90" attention_tc &
build attention_wg "$SM90A" attention_wg &
build attention_wg_swap_k "$SM90A" attention_wg -DSTRATA_WG_SWAP_LBO=1 &
build attention_wg_swap_v "$SM90A" attention_wg -DSTRATA_WG_SWAP_MN=1 &
build attention_wg_swap_kv "$SM90A" attention_wg -DSTRATA_WG_SWAP_LBO=1 -DSTRATA_WG_SWAP_MN=1 &
build attention_wg_pipe "$SM90A" "$tmp/attention_wg.cu" &
wait
ls -l .whl/moe_gemm_{mma,wg,wg_swap}.fatbin .whl/attention_{tc,wg,wg_swap_k,wg_swap_v,wg_swap_kv,wg_pipe}.fatbin
