#!/usr/bin/env bash
# `make demo`: build rpma; probe the persistence domain of a scratch file under the repo
# (page-cache), of one under /dev/shm (volatile) and of the same with the force_dax override
# (dax (forced)); start a target on those two (the /dev/shm one with force_dax, so the pmem
# path is what runs), write a pattern durably, read and verify it, show identify output and a
# short latency/bandwidth run, stop the target. Cleans up after itself, also on failure or ^C.
set -euo pipefail
cd "$(dirname "$0")/.."
# Builds; BIN, SCRATCH (under the repo: its files are page-cache), shm and URL; removed on exit.
# shellcheck source=scripts/local-target.sh
. scripts/local-target.sh
local_setup demo
NQN=nqn.2026-11.io.rpma:demo
HOSTNQN=nqn.2026-11.io.rpma:demo-host

# One probe: its label and the domain line of rpma-target probe (a failed probe stops the demo).
show() {
    local label=$1 out
    shift
    out=$("$BIN/rpma-target" probe "$@")
    printf '  %-44s %s\n' "$label" "$(sed -n 's/^domain: *//p' <<<"$out")"
}
rel=${SCRATCH#"$PWD"/}
echo "== persistence domains, as rpma-target probe finds them"
show "$rel/ns2.pmem (under the repo)" "$SCRATCH/ns2.pmem" --size 8MiB
show "$shm" "$shm" --size 64MiB
show "$shm --force-dax" "$shm" --force-dax
write_config "$NQN" "$HOSTNQN" 64MiB 8MiB

echo
echo "== rpma-target on $URL"
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"

ini() { "$BIN/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" "$@"; }

echo
echo "== identify"
ini identify
echo
echo "== list (the durability method this host uses on each namespace: FLUSH on dax,"
echo "   GPSPM on page-cache, whose sync keeps the target's other busy connections running)"
ini list
echo
echo "== write 8 MiB of 0x5a at 1 MiB, durably"
ini write --offset 1MiB --pattern 0x5a --length 8MiB --durable
ini --nsid 2 write --offset 0 --pattern 0x5a --length 1MiB --durable
echo
echo "== read 32 bytes of it back"
ini read --offset 1MiB --length 32 | od -A d -t x1 | head -2
echo
echo "== verify the 8 MiB"
ini verify --offset 1MiB --pattern 0x5a --length 8MiB
echo
echo "== a short benchmark: QD1 latency, then bandwidth"
ini bench --offset 16MiB --count 2000 --total 32MiB

echo
"$BIN/rpma-target" status --socket "$SCRATCH/control.sock" | head -20 || true
rc=0
stop_target || rc=$?
echo
echo "rpma-target stopped (exit $rc)"
