#!/usr/bin/env bash
# One bench command in several Python trees that share this tree's build, in one device call: for a
# bisect of a host-side (Python) change, where the kernels and the extension are the same in every
# tree, so each tree costs a run, not a build. Rounds alternate the trees' order, so drift of the
# machine (clocks, page cache) shows as noise, not as a difference.
#
#   # here, once per tree (only the package; the demo's weights stay out):
#   git archive C -- strata ':!strata/demo/*.bin' | (mkdir -p ab_trees/C && tar -x -C ab_trees/C)
#   tools/trees_device_check.sh [bench arguments...]
#
# With --script PATH first, each tree runs `python PATH arguments...` (a tool of this tree, e.g.
# tools/decode_steps.py) instead of `python -m strata bench`. Default bench arguments: --synthetic qwen3-30b-a3b --device cuda --vram-budget-gib 8 --prompt 16384
# --decode 64. TREES (default ab_trees) holds the trees; this tree runs as "HEAD". ROUNDS (default 2),
# DEADLINE_S (default 560). Each run's JSON and log go to LOGS (default /tmp/strata-trees); with OUT
# set (the device tool's folder) they come back as one OUT/logs.tgz, and a table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
RETURN=${OUT:-}
OUT=${LOGS:-/tmp/strata-trees}
mkdir -p "$OUT"
trap '[ -n "$RETURN" ] && tar -czf "$RETURN/logs.tgz" -C "$OUT" . 2>/dev/null' EXIT
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 STRATA_CUDA_ARCHS=${STRATA_CUDA_ARCHS:-90}
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
TREES=${TREES:-ab_trees} ROUNDS=${ROUNDS:-2}
. tools/device_deadline.sh
script=
# the script runs from a copy in /tmp: a tool that puts its repository first on sys.path (as
# stream_check.py does) would otherwise import this tree's strata in every tree
[ "${1:-}" = --script ] && { mkdir -p /tmp/trees_tools && cp "$2" /tmp/trees_tools/ && script=/tmp/trees_tools/$(basename "$2"); shift 2; }
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--synthetic qwen3-30b-a3b --device cuda --vram-budget-gib 8 --prompt 16384 --decode 64)
shape=qwen3-30b-a3b
for i in "${!args[@]}"; do [ "${args[$i]}" = --synthetic ] && shape=${args[$((i + 1))]}; done

start_pack "$shape" 200
OUT=$OUT timeout "$(budget 200)" bash tools/device_check.sh tests/kernels/test_runtime.py 2>&1 | tail -3
export PYTHONPATH=/tmp/strata-site${PYTHONPATH:+:$PYTHONPATH}
wait $pack_pid
cat "$OUT/pack.log"

trees=(HEAD)
for d in "$TREES"/*/; do
    [ -d "$d/strata" ] || continue
    t=$(basename "$d"); trees+=("$t")
    cp strata/_ext/*.so "$d/strata/_ext/"            # this tree's build: same sources in every tree
    cp strata/kernels/*.fatbin strata/kernels/manifest.json "$d/strata/kernels/"
done
echo "trees: ${trees[*]}"
for r in $(seq 1 "$ROUNDS"); do
    order=("${trees[@]}")
    [ $((r % 2)) -eq 0 ] && order=($(printf '%s\n' "${trees[@]}" | tac))
    for t in "${order[@]}"; do
        [ "$(budget 60)" -lt 60 ] && { echo "deadline: stopping before $t round $r"; break 2; }
        root=$PWD; [ "$t" != HEAD ] && root=$PWD/$TREES/$t
        echo "== round $r, $t ($(elapsed) s)"
        ( cd /tmp && PYTHONPATH=$root:$PYTHONPATH timeout "$(budget 120)" $PY ${script:--m strata bench} "${args[@]}" \
            --json "$OUT/$t.$r.json" >"$OUT/$t.$r.log" 2>"$OUT/$t.$r.err" ) || tail -5 "$OUT/$t.$r.err"
        tail -4 "$OUT/$t.$r.log"
    done
done
echo "== table"
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
rows = {}
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    tree, rnd = p.stem.rsplit(".", 1)
    try:
        d = json.loads(p.read_text())
    except ValueError:
        continue
    for what in ("prompt", "decode"):
        for n, r in (d.get(what) or {}).items():
            rows.setdefault((tree, what, n), []).append(round(float(r["tok_s"]), 1))
for (tree, what, n), vals in sorted(rows.items()):
    print(f"{tree:>10} {what:>7} {n:>6}: {vals} tok/s")
EOF
