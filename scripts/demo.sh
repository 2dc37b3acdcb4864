#!/usr/bin/env bash
# `make demo`: build rpma and show it working on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p rpma-target -p rpma-initiator
BIN=build/release
SCRATCH=${SCRATCH:-$PWD/scratch}
mkdir -p "$SCRATCH"
shm=/dev/shm/rpma-demo-$$.pmem
target_pid=
cleanup() {
    if [ -n "$target_pid" ]; then kill "$target_pid" 2>/dev/null || true; fi
    rm -f "$shm"
}
trap cleanup EXIT

echo "== a scratch file under the repo"
"$BIN/rpma-target" probe "$SCRATCH/demo.pmem" --size 64MiB --grow
echo
echo "== a scratch file under /dev/shm"
"$BIN/rpma-target" probe "$shm" --size 64MiB
echo
echo "== the same file with force_dax (testing on DRAM)"
"$BIN/rpma-target" probe "$shm" --force-dax

echo
echo "== a target on a scratch config, identified from a host, then stopped"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$SCRATCH/demo-target.toml" <<EOF
listen = ["tcp://127.0.0.1:$port"]
control_socket = "demo-control.sock"
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:demo"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
path = "demo-ns1.pmem"
size = "16MiB"
EOF
"$BIN/rpma-target" --config "$SCRATCH/demo-target.toml" &
target_pid=$!
for _ in $(seq 100); do
    "$BIN/rpma-target" status --socket "$SCRATCH/demo-control.sock" >/dev/null 2>&1 && break
    sleep 0.1
done
"$BIN/rpma-initiator" discover --target "tcp://127.0.0.1:$port"
"$BIN/rpma-initiator" identify --target "tcp://127.0.0.1:$port" --nqn nqn.2026-11.io.rpma:demo
kill -TERM "$target_pid"
rc=0
wait "$target_pid" || rc=$?
target_pid=
echo "rpma-target stopped (exit $rc)"
