#!/usr/bin/env bash
# The plain-cache variant of the quantized split-K decode attention (cuda/kv_quant.cu, #14), to be
# measured before it replaces the kernel. The sums are meant to be the tree's bit for bit; only the
# instructions around them change:
#   - a decode step over a plain cache (no drafter ring, no --kv-resident VRAM window: ring and
#     vram_cells 0, every step of a plain decode) takes a second instantiation of the tile loop whose
#     addresses are one multiply from a per-plane base, and whose cells past the end read cell end - 1
#     instead of predicated zeros (their scores are -inf, so p = 0 and their P' V terms are zeros);
#   - each warp's first tile is loaded before the query is prepared, the next tile's K once this
#     tile's scores are made and its V once this tile's P' V is done (no extra registers: a half is
#     reloaded only when it is spent);
#   - the accumulator's rescale is skipped when no lane's running max moved (alpha 1: x * 1 is x);
#   - V's scales split into 2^k and mant with f16-pair arithmetic (dV * 2^-k is an exact f16 product);
#   - q4 codes unpacked with one lop3 for the mask and the magic (the compiler had made two), V's odd
#     nibbles read in place as 16 (code - 8) and scaled by 2^k / 16 (exact; one shift a word, not three).
# The last two were checked exhaustively in numpy (every f16 scale, every code and exponent).
# SASS (sm_90, nvcc 13.0) of the tile loop at Dh 128, G 8: q4_0 1,281 instructions a 32-cell tile
# (the tree's loop: 3,227 in all, 1,893 even with ring and the VRAM window known to be 0), int8 1,035
# (2,675; 1,374). Registers 224-255 at Dh 128 (the tree: 224-255), no spills anywhere (the tree spills
# 4-68 bytes in 13 of its 42 kernels). The fatbin is twice the size (two loops a kernel).
#
#   tools/variants/make_kv_plain.sh        -> .whl/kv_quant_plain.cu
#
# Then, over a build on the GPU machine (.whl carried), the digests must be equal and the bench says
# which is faster (this build, the variant, this build again):
#   KV_PARENT=.whl/kv_quant_plain.cu BUNDLE=1 tools/spec_kv_device_check.sh tests kvdigest kvbench kvncu
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
cp cuda/kv_quant.cu .whl/kv_quant_plain.cu
patch -s .whl/kv_quant_plain.cu tools/variants/kv_quant_plain.patch
echo ".whl/kv_quant_plain.cu"
