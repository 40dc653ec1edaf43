#!/usr/bin/env bash
# The XS variant of cuda/moe_decode.cu (#16), written this way to be measured before it replaces the
# kernel: Q4_K's held path reads x from the staged row in shared memory (the unit's two sums kept in
# its padding) instead of holding 64 x values a lane (moe_decode_xs.patch); XSD also keeps two of
# gate|up's row sets in flight (moe_decode_xsd.patch, over XS). Other paths of Q4_K trap (an
# experiment: the bench's shapes never take them). ptxas, Q4_K, registers (spill stores): XS 120 /
# 80 (0) / 64 (0) at 2 / 3 / 4 blocks an SM; XSD 124 (0) / 80 (64 B) / 64 (124 B).
#
#   tools/variants/make_moe_decode_xs.sh [N...]   -> .whl/moe_decode_xsN.cu and .whl/moe_decode_xsdN.cu,
#                                                    N blocks an SM (default 2 3 4)
#
# Then: MOE_TYPES=Q4_K MOE_VARIANTS="cuda/moe_decode.cu .whl/moe_decode_xs2.cu ..."
#       tools/decode_device_check.sh moeab      (speed and the outputs' sha256 beside this build's)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
for n in "${@:-2 3 4}"; do
    for m in $n; do
        cp cuda/moe_decode.cu /tmp/moe_decode_xs.cu
        patch -s /tmp/moe_decode_xs.cu tools/variants/moe_decode_xs.patch
        cp /tmp/moe_decode_xs.cu /tmp/moe_decode_xsd.cu
        patch -s /tmp/moe_decode_xsd.cu tools/variants/moe_decode_xsd.patch
        for v in xs xsd; do
            sed "s/__launch_bounds__(kThreads, 2)/__launch_bounds__(kThreads, $m)/g" /tmp/moe_decode_$v.cu >".whl/moe_decode_$v$m.cu"
            echo ".whl/moe_decode_$v$m.cu"
        done
    done
done
