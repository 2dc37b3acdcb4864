#!/usr/bin/env bash
# scripts/reliability.sh: the long reliability run (issue 14; docs/reliability.md). `make
# reliability` runs it; `make test` runs the short versions of the same suites.
#
#   scripts/reliability.sh [--cycles N] [--seed S] [--run-ms MIN-MAX] [--out FILE]
#                          [--fuzz-seconds N] [--only crash,faults,fuzz]
#
#   crash   rpma-crash (tests/src/crash): N cycles (default 200, at least 200 for the figures
#           docs/reliability.md quotes) of SIGKILL and restart of a target whose namespaces run
#           under the power-loss simulation (a page-cache file and a forced-dax /dev/shm file),
#           while APM, GPSPM, FLUSH, NBD FUA and NBD FLUSH writers write; every acknowledged
#           block is checked after every restart. Any loss fails the run.
#   faults  tests/tests/link_faults.rs and load.rs with RPMA_RELIABILITY_LONG=1: minutes of random
#           cuts, resets, stalls and packet loss under load, and 32 connections of mixed calls;
#           no hang, no acknowledged write lost, the target back to baseline, memory and fds flat.
#   fuzz    scripts/fuzz.sh --seconds N (--fuzz-seconds, default 600) for every fuzz target.
#
#   Sections: --only crash,faults,fuzz (default: all three).
#
# Writes the figures to FILE (default tests/results/reliability.txt; the crash run's JSON
# beside it as crash.json). Exits non-zero if a suite fails; the file says which.
set -euo pipefail
cd "$(dirname "$0")/.."

cycles=200
seed=$(date +%s)
run_ms=30-300
fuzz_seconds=600
only=crash,faults,fuzz
out=tests/results/reliability.txt
while [ $# -gt 0 ]; do
    case $1 in
        --cycles) cycles=$2; shift 2 ;;
        --seed) seed=$2; shift 2 ;;
        --run-ms) run_ms=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --fuzz-seconds) fuzz_seconds=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "scripts/reliability.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
CARGO=${CARGO:-cargo}
mkdir -p "$(dirname "$out")"
json="$(dirname "$out")/crash.json"

# rpma-crash starts the rpma-target and rpma-initiator of its own build directory.
$CARGO build --workspace --all-features

status=0
# Asked before the figures file (tracked) is rewritten, and without what a run itself writes
# (the results, the grown fuzz corpus), or every run would say "with local changes".
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD -- . ':(exclude)tests/results' ':(exclude)fuzz/corpus' 2>/dev/null \
    || commit+=" (with local changes)"
{
    echo "# rpma reliability run"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $commit"
    echo "machine: $(nproc) CPUs, $(uname -sr); $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
    echo
} >"$out"
wants() { [[ ",$only," == *",$1,"* ]]; }
if wants crash; then
    echo "## crash consistency (rpma-crash --cycles $cycles --seed $seed --run-ms $run_ms)" >>"$out"
    if ! $CARGO run -q --all-features -p rpma-tests --bin rpma-crash -- \
        --cycles "$cycles" --seed "$seed" --run-ms "$run_ms" --json "$json" >>"$out"; then
        status=1
        echo "crash consistency: FAILED" >>"$out"
    fi
fi
if wants faults; then
    figures=$(cd "$(dirname "$out")" && pwd)/faults.txt
    rm -f "$figures"
    echo >>"$out"
    echo "## link faults and load (RPMA_RELIABILITY_LONG=1: tests link_faults, load)" >>"$out"
    if RPMA_RELIABILITY_LONG=1 RPMA_RELIABILITY_FIGURES=$figures $CARGO test -q --all-features \
        -p rpma-tests --test link_faults --test load >/dev/null 2>&1; then
        :
    else
        status=1
        echo "link faults and load: FAILED (rerun: RPMA_RELIABILITY_LONG=1 cargo test -p rpma-tests --test link_faults --test load)" >>"$out"
    fi
    [ -f "$figures" ] && cat "$figures" >>"$out"
fi
if wants fuzz; then
    echo >>"$out"
    echo "## fuzzing (scripts/fuzz.sh --seconds $fuzz_seconds per target)" >>"$out"
    # The build and libFuzzer's own output go to a log beside the figures; the figures table
    # into them. The corpus grows in fuzz/corpus: `scripts/fuzz.sh --minimize` before committing.
    if ! bash scripts/fuzz.sh --seconds "$fuzz_seconds" >>"$out" 2>"$(dirname "$out")/fuzz.log"; then
        status=1
        echo "fuzzing: FAILED (a crash: fuzz/artifacts/TARGET/; log: $(dirname "$out")/fuzz.log)" >>"$out"
    fi
fi
cat "$out"
exit "$status"
