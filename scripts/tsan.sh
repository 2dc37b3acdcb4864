#!/usr/bin/env bash
# make tsan: the concurrency tests of the shared-memory paths under ThreadSanitizer
# (docs/reliability.md, "Race detection"):
#   - two sessions placing into one range from two poll loops, a Read Response sent from it
#     meanwhile, the owner copying it out (common/tests/fabric_race.rs), and the fabric tests
#     that run peers on threads of their own;
#   - VolatileSlice's copies and the power-loss simulation's eviction thread racing persists
#     (rpma-common unit tests);
#   - the flusher: GPSPM syncs from the poll loops on a worker thread (rpma-target unit tests).
#
# Usage: scripts/tsan.sh            the tests above, on this tree
#        scripts/tsan.sh --at REV   fabric_race.rs (of this tree) against the fabric of REV,
#                                   an older commit, run up to 8 times until a run is flagged:
#                                   how the old receive path was caught (exit 66 when flagged,
#                                   0 when all 8 runs were clean)
#
# A race detector samples: it reports a race when the racing access is still in its history
# (history_size=7, the most), so one clean run proves nothing by itself, and a fault in the
# placement paths is caught in about one run of two (measured on the old receive path; --at
# repeats for that reason). `make test` runs this every time.
#
# Toolchain: -Zsanitizer=thread is a nightly-only flag; on a stable rustc the script sets
# RUSTC_BOOTSTRAP=1, which lets it accept it (checked with rustc 1.95). std is not rebuilt with
# the sanitizer (-Cunsafe-allow-abi-mismatch=sanitizer): scripts/tsan.supp suppresses the false
# positives that follow, narrowly. `--cfg rpma_tsan` makes VolatileSlice's copies atomic accesses
# (rpma_common::volatile, "Under ThreadSanitizer") and std's contended Mutex visible
# (rpma_common::sync). Builds go to build/tsan (the host target given explicitly, so that build
# scripts and proc macros are not instrumented). Exit status: 0 clean, non-zero on any report or
# failed test.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

at=""
case "${1:-}" in
  --at) at="${2:?--at needs a revision}" ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "tsan.sh: unknown argument $1 (--help)" >&2; exit 64 ;;
esac

if ! rustc -vV | grep -q '^release: .*nightly'; then
  export RUSTC_BOOTSTRAP=1
fi
host=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Zsanitizer=thread -Cunsafe-allow-abi-mismatch=sanitizer --cfg rpma_tsan"
export TSAN_OPTIONS="suppressions=$root/scripts/tsan.supp history_size=7 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
# The test binaries run the tests of each file on two threads at most: under the sanitizer a
# test is 5-15 times slower, and the machines have two cores.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-2}

if [ -n "$at" ]; then
  rev=$(git rev-parse --short "$at^{commit}")
  tree="$root/build/tsan-at/$rev"
  rm -rf "$tree"
  mkdir -p "$tree"
  git archive "$rev" | tar -x -C "$tree"
  cp common/tests/fabric_race.rs "$tree/common/tests/fabric_race.rs"
  echo "tsan: common/tests/fabric_race.rs against the fabric of $rev ($tree)" >&2
  cd "$tree"
  exe=$(cargo test --target "$host" --target-dir "$root/build/tsan" -p rpma-common \
    --test fabric_race --no-run 2>&1 | tee /dev/stderr | sed -n 's/^ *Executable .*(\(.*\))$/\1/p')
  case "$exe" in /*) ;; *) exe="$tree/$exe" ;; esac
  for run in 1 2 3 4 5 6 7 8; do
    if "$exe"; then
      echo "tsan: run $run of $rev clean" >&2
    else
      status=$?
      echo "tsan: run $run of $rev FLAGGED (exit $status)" >&2
      exit "$status"
    fi
  done
  exit 0
fi

run() { cargo test --target "$host" --target-dir build/tsan "$@"; }
run -p rpma-common --lib -- volatile:: pmem::sim::
run -p rpma-common --test fabric_race --test fabric_placement --test fabric_loopback \
  --test fabric_wait --test fabric_raw_peer --test fabric_errors --test pmem_persist
run -p rpma-target --lib -- flusher::
echo "tsan: clean" >&2
