#!/usr/bin/env bash
# The prompt kernels on Hopper's wgmma (#17: cuda/moe_gemm_ws.cu, cuda/attention_wg.cu, cuda/attention_ws.cu)
# beside this tree's mma.sync builds (cuda/moe_gemm.cu, cuda/attention_tc.cu), as fatbins for tools/moe_gemm_ab.py and
# tools/attention_wg_ab.py: no package build on the GPU machine. (The eighteenth session's H100 settled
# the descriptors: the builds with the leading and stride offsets exchanged failed every check, the
# PTX manual's reading passed, and those arms are gone; so is the pipelined attention patch, correct
# but 1.8x slower than attention_tc.cu on a 4096-token chunk.)
#
#   tools/variants/make_wgmma.sh   -> .whl/moe_gemm_{mma,ws}.fatbin, .whl/attention_{tc,wg,ws}.fatbin,
#                                     .whl/wgmma_rate.fatbin (tools/wgmma_rate.py), .whl/pdl_stage.fatbin
#                                     (tools/pdl_chain_bench.py)
#
# Then on the GPU machine, .whl carried (a minute or two, most of it making random weights):
#   python3 tools/moe_gemm_ab.py --arm mma:.whl/moe_gemm_mma.fatbin:strata_moe_gemm \
#       --arm ws:.whl/moe_gemm_ws.fatbin:strata_moe_gemm_ws:ws
#   python3 tools/attention_wg_ab.py --arm tc:.whl/attention_tc.fatbin:strata_attention_prefill_tc_f16 \
#       --arm wg:.whl/attention_wg.fatbin:strata_attention_prefill_wg_f16 \
#       --arm ws:.whl/attention_ws.fatbin:strata_attention_prefill_ws128_f16:128:384:163968
# (tools/nobuild_ab.sh runs these, each wgmma arm's checks in a process of its own.)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
SM90="-arch=sm_90"
SM90A="-gencode=arch=compute_90a,code=sm_90a"
build() {   # build OUT ARCH SRC: SRC cuda/<SRC>.cu
    nvcc -fatbin -O3 -std=c++17 "$2" -Icuda -o ".whl/$1.fatbin" "cuda/$3.cu"
}
build moe_gemm_mma "$SM90" moe_gemm &
build moe_gemm_ws "$SM90A" moe_gemm_ws &
# moe_gemm_ws.cu's trial builds (tools/variants/gemm_ws_ab.sh's arms)
nvcc -fatbin -O3 -std=c++17 "$SM90A" -Icuda -DSTRATA_WS_GEMM_PRODUCERS=1 -o .whl/moe_gemm_ws1.fatbin cuda/moe_gemm_ws.cu &
nvcc -fatbin -O3 -std=c++17 "$SM90A" -Icuda -DSTRATA_WS_GEMM_PREFETCH -o .whl/moe_gemm_wsp.fatbin cuda/moe_gemm_ws.cu &
nvcc -fatbin -O3 -std=c++17 "$SM90A" -Icuda -DSTRATA_WS_GEMM_STAGES=6 -o .whl/moe_gemm_ws_s6.fatbin cuda/moe_gemm_ws.cu &
nvcc -fatbin -O3 -std=c++17 "$SM90A" -Icuda -DSTRATA_WS_GEMM_BN=256 -DSTRATA_WS_GEMM_PRODUCERS=1 \
    -o .whl/moe_gemm_ws_n256.fatbin cuda/moe_gemm_ws.cu &
build dequant "$SM90" dequant &     # strata_dequant_h_<type>: gemm_ws_ab.sh's dequantize-then-f16 arm
build attention_tc "$SM90" attention_tc &
build attention_wg "$SM90A" attention_wg &
build attention_ws "$SM90A" attention_ws &
nvcc -fatbin -O3 -std=c++17 "$SM90A" -Icuda -o .whl/wgmma_rate.fatbin tools/variants/wgmma_rate.cu &
nvcc -fatbin -O3 -std=c++17 "$SM90" -Icuda -o .whl/pdl_stage.fatbin tools/variants/pdl_stage.cu &   # tools/pdl_chain_bench.py (#16)
wait
ls -l .whl/moe_gemm_{mma,ws}.fatbin .whl/attention_{tc,wg,ws}.fatbin .whl/wgmma_rate.fatbin
