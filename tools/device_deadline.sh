# Sourced by the device scripts that run inside a deadline (tools/stream_device_check.sh,
# tools/decode_graph_check.sh): needs PY, OUT, DEADLINE_S and T0 (date +%s at the start) set.
#
#   elapsed                  seconds since T0
#   budget SECONDS           SECONDS, or what is left of DEADLINE_S if that is less
#   start_pack SHAPE SECS    build the synthetic pack SHAPE in the background (its log: $OUT/pack.log,
#                            its pid: $pack_pid), with numpy and gguf from .whl/ in a site dir of its
#                            own, so device_check's installs are untouched

elapsed() { echo $(( $(date +%s) - T0 )); }
budget() { local left=$(( DEADLINE_S - $(elapsed) )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }

start_pack() {
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/strata-pack-site \
        $(ls .whl/*.whl 2>/dev/null | grep -v '/nvidia_') >/dev/null 2>&1
    ( PYTHONPATH=/tmp/strata-pack-site timeout "$(budget "$2")" $PY -c \
        "from strata.synthetic import synthetic_pack; print(synthetic_pack('$1', progress=False))"
      echo "pack rc=$? at $(elapsed) s" ) >"$OUT/pack.log" 2>&1 &
    pack_pid=$!
}
