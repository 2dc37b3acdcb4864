#!/usr/bin/env bash
# The VM part of `make test` (`make vm-test` alone): sets the lab up (scripts/vm-setup.sh),
# builds the workspace and its test binaries on the host, then boots two guests
# (scripts/vm-run.sh) and runs in each the device tests that are ignored on the host
# (tests/vm/suite.sh): the Debian trixie-backports kernel (Soft-RoCE with ODP, fsdax, devdax,
# nbd, md, nvme-tcp) runs all but the `no_odp` ones, Debian 12's 6.1 kernel (Soft-RoCE without
# ODP) runs those. Fails if a guest cannot boot, if any test fails, or if any is not run.
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
for kernel in ${RPMA_VM_KERNELS:-odp stock}; do
  t0=$(date +%s)
  echo "vm-test: booting the $kernel kernel" >&2
  if ! bash scripts/vm-run.sh --kernel "$kernel" --timeout 2400 -- \
    "$ROOT/tests/vm/suite.sh" "$kernel" "$LIST"; then
    status=1
    [ -s "$OUT/$kernel.summary" ] || echo "vm-test: the $kernel guest did not run its suite" \
      "(boot or lab set-up failed: see above)" >&2
  fi
  echo "vm-test: $kernel guest: $(($(date +%s) - t0)) s" >&2
done

echo
echo "=== VM lab summary (logs: $OUT/logs) ==="
for kernel in ${RPMA_VM_KERNELS:-odp stock}; do
  grep -E '^    (FAILED|.* did not finish)' "$OUT/$kernel.summary" 2>/dev/null || true
  tail -1 "$OUT/$kernel.summary" 2>/dev/null || echo "suite ($kernel kernel): did not run"
done
echo "vm-test: the VM part took $(($(date +%s) - start)) s"
exit "$status"
