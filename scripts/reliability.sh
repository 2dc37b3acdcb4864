#!/usr/bin/env bash
# scripts/reliability.sh: the long reliability run (issue 14; docs/reliability.md). `make
# reliability` runs it; `make test` runs the short versions of the same suites.
#
#   scripts/reliability.sh [--cycles N] [--seed S] [--run-ms MIN-MAX] [--out FILE]
#
#   crash   rpma-crash (tests/src/crash): N cycles (default 200, at least 200 for the figures
#           docs/reliability.md quotes) of SIGKILL and restart of a target whose namespaces run
#           under the power-loss simulation (a page-cache file and a forced-dax /dev/shm file),
#           while APM, GPSPM, FLUSH, NBD FUA and NBD FLUSH writers write; every acknowledged
#           block is checked after every restart. Any loss fails the run.
#
# Writes the figures to FILE (default tests/results/reliability.txt; the crash run's JSON
# beside it as crash.json). Exits non-zero if a suite fails; the file says which.
set -euo pipefail
cd "$(dirname "$0")/.."

cycles=200
seed=$(date +%s)
run_ms=30-300
out=tests/results/reliability.txt
while [ $# -gt 0 ]; do
    case $1 in
        --cycles) cycles=$2; shift 2 ;;
        --seed) seed=$2; shift 2 ;;
        --run-ms) run_ms=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "scripts/reliability.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
CARGO=${CARGO:-cargo}
mkdir -p "$(dirname "$out")"
json="$(dirname "$out")/crash.json"

# rpma-crash starts the rpma-target and rpma-initiator of its own build directory.
$CARGO build --workspace --all-features

status=0
{
    echo "# rpma reliability run"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "machine: $(nproc) CPUs, $(uname -sr)"
    echo
    echo "## crash consistency (rpma-crash --cycles $cycles --seed $seed --run-ms $run_ms)"
} >"$out"
if $CARGO run -q --all-features -p rpma-tests --bin rpma-crash -- \
    --cycles "$cycles" --seed "$seed" --run-ms "$run_ms" --json "$json" >>"$out"; then
    :
else
    status=$?
    echo "crash consistency: FAILED (exit $status)" >>"$out"
fi
cat "$out"
exit "$status"
