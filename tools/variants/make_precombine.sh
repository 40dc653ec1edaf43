#!/usr/bin/env bash
# cuda/attention.cu as it was before fc452d8 (the decode combine reading every split, empty ones too), as a
# fatbin for tools/decode_device_check.sh's ctx16 step: the decode after 16,384 cells with that combine
# against this tree's (the kernels' signatures are the same).
#
#   tools/variants/make_precombine.sh   -> .whl/attention_precombine.fatbin (sm_90)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive fc452d8^ cuda | tar -x -C "$tmp"
nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -I"$tmp/cuda" -o .whl/attention_precombine.fatbin "$tmp/cuda/attention.cu"
ls -l .whl/attention_precombine.fatbin
