#!/usr/bin/env bash
# cuda/attention.cu with other decode combines, as fatbins for tools/decode_device_check.sh's `combine` and
# `ctx16` steps (the kernels' signatures are the same):
#   attention_precombine.fatbin   before fc452d8: every split read, empty ones too
#   attention_skiplist.fatbin     at acfcca8: the used splits listed by a ballot, read eight loads ahead
#   attention_plain.fatbin        at fb542fb: the splits up to the last used one, one load and its FMA a split
# The tree's combine reads the splits up to the last used one, a chunk of 16 splits' loads before their
# FMAs (the same chain of fmaf, so the same bits as plain's).
#
#   tools/variants/make_combine_arms.sh   -> .whl/attention_{precombine,skiplist,plain}.fatbin (sm_90)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
pids=() dirs=()
for arm in precombine:fc452d8^ skiplist:acfcca8 plain:fb542fb; do
    name=${arm%%:*} rev=${arm#*:}
    tmp=$(mktemp -d)
    dirs+=("$tmp")
    git archive "$rev" cuda | tar -x -C "$tmp"
    nvcc -fatbin -O3 -std=c++17 -arch=sm_90 -I"$tmp/cuda" -o ".whl/attention_$name.fatbin" "$tmp/cuda/attention.cu" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
rm -rf "${dirs[@]}"
[ $rc -eq 0 ] && ls -l .whl/attention_{precombine,skiplist,plain}.fatbin
exit $rc
