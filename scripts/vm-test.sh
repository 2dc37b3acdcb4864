#!/usr/bin/env bash
# The VM part of `make test` (`make vm-test` alone): sets the lab up (scripts/vm-setup.sh),
# builds the workspace and its test binaries on the host, then boots two guests
# (scripts/vm-run.sh) and runs in each the device tests that are ignored on the host
# (tests/vm/suite.sh): the Debian trixie-backports kernel (Soft-RoCE with ODP, fsdax, devdax,
# nbd, md, nvme-tcp) runs all but the `no_odp` ones, Debian 12's 6.1 kernel (Soft-RoCE without
# ODP) runs those. Fails if a guest cannot boot (three times: one that does not reach its suite,
# or hangs in its boot, is booted again), if any test fails, or if any is not run.
# Prints each guest's summary and the VM part's time. docs/testing.md says what runs where.
#
# Environment: CARGO, FEATURES (as the Makefile), RPMA_VM_KERNELS (default "odp stock"), and
# what scripts/vm-run.sh takes (RPMA_VM_ACCEL, RPMA_VMLAB_DIR, ...).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
LAB="${RPMA_VMLAB_DIR:-$ROOT/build/vmlab}"
CARGO="${CARGO:-cargo}"
FEATURES="${FEATURES:---all-features}"
start=$(date +%s)

bash scripts/vm-setup.sh

# The binaries the tests start, and the test executables with their package directories.
# shellcheck disable=SC2086
"$CARGO" build --workspace $FEATURES
OUT="${RPMA_VM_OUT:-$LAB/out}"
rm -rf "$OUT"
mkdir -p "$OUT"
LIST="$OUT/tests.list"
# shellcheck disable=SC2086
"$CARGO" test --workspace $FEATURES --no-run --message-format=json-render-diagnostics | python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"], os.path.dirname(m["manifest_path"]))
' | sort -u >"$LIST"
[ -s "$LIST" ] || { echo "vm-test: cargo listed no test executables" >&2; exit 1; }

export RPMA_VM_OUT="$OUT"
status=0
# Each guest's console (the guest lab's set-up, the suite's output) also goes to
# $OUT/KERNEL.console[.N]. A guest that never reached its suite (suite.sh writes its summary file
# first thing) failed to boot or to set the lab up, and one whose summary has no last line died
# in its suite: either is booted again, up to three boots in all (a bad boot has come right after
# another one that was killed, and a guest has vanished seconds into its tests: docs/testing.md),
# and the summary below repeats what its console said last, since a CI log may keep only its
# own tail.
BOOTS=3
for kernel in ${RPMA_VM_KERNELS:-odp stock}; do
  t0=$(date +%s)
  for attempt in $(seq "$BOOTS"); do
    console="$OUT/$kernel.console.$attempt"
    echo "vm-test: booting the $kernel kernel (attempt $attempt)" >&2
    a0=$(date +%s)
    rc=0
    bash scripts/vm-run.sh --kernel "$kernel" --timeout 2400 -- \
      "$ROOT/tests/vm/suite.sh" "$kernel" "$LIST" 2>&1 | tee "$console" || rc=$?
    [ "$rc" -eq 0 ] && break
    # A suite that ran to its end (its last line says how many passed and failed) failed:
    # that is the answer. One whose guest died before that (its summary has no last line: the
    # guest vanished seconds into its tests once, its console silent) is booted again, as a
    # guest that never reached its suite is.
    if grep -q '^suite (' "$OUT/$kernel.summary" 2>/dev/null; then
      status=1
      break
    fi
    if [ -e "$OUT/$kernel.summary" ]; then
      echo "vm-test: the $kernel guest died before its suite finished: exit $rc after" \
        "$(($(date +%s) - a0)) s; its summary so far:" | tee -a "$console" >&2
      sed 's/^/    | /' "$OUT/$kernel.summary" | tee -a "$console" >&2
    else
      echo "vm-test: the $kernel guest did not reach its suite (boot or lab set-up failed):" \
        "exit $rc after $(($(date +%s) - a0)) s" | tee -a "$console" >&2
    fi
    [ "$attempt" -eq "$BOOTS" ] && status=1
  done
  echo "vm-test: $kernel guest: $(($(date +%s) - t0)) s" >&2
done

echo
echo "=== VM lab summary (logs: $OUT/logs) ==="
for kernel in ${RPMA_VM_KERNELS:-odp stock}; do
  grep -E '^    (FAILED|.* did not finish)' "$OUT/$kernel.summary" 2>/dev/null || true
  tail -1 "$OUT/$kernel.summary" 2>/dev/null || echo "suite ($kernel kernel): did not run"
done
# Last, where a log's tail shows it: what each boot that did not reach its suite said last.
for kernel in ${RPMA_VM_KERNELS:-odp stock}; do
  for attempt in $(seq "$BOOTS"); do
    console="$OUT/$kernel.console.$attempt"
    [ -e "$console" ] || continue
    if [ -e "$OUT/$kernel.console.$((attempt + 1))" ] || [ ! -e "$OUT/$kernel.summary" ]; then
      echo "the $kernel guest's boot $attempt did not reach its suite; its console's last lines:"
      tail -8 "$console" | cut -c1-300 | sed 's/^/    | /'
    fi
  done
done
echo "vm-test: the VM part took $(($(date +%s) - start)) s"
exit "$status"
