#!/usr/bin/env bash
# `make demo`: build rpma and show it working on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p rpma-target
BIN=build/release
SCRATCH=${SCRATCH:-$PWD/scratch}
mkdir -p "$SCRATCH"
shm=/dev/shm/rpma-demo-$$.pmem
trap 'rm -f "$shm"' EXIT

echo "== a scratch file under the repo"
"$BIN/rpma-target" probe "$SCRATCH/demo.pmem" --size 64MiB --grow
echo
echo "== a scratch file under /dev/shm"
"$BIN/rpma-target" probe "$shm" --size 64MiB
echo
echo "== the same file with force_dax (testing on DRAM)"
"$BIN/rpma-target" probe "$shm" --force-dax
