#!/bin/bash
# Inside a VM lab guest (after guest-lab.sh): runs the workspace's device tests, the ones that
# are `#[ignore]`d on the host because they need the real stack (Soft-RoCE, DAX, kernel block
# clients). Every ignored test of every test binary is run in one of the two guests, none is
# skipped: on the `stock` kernel (rxe without ODP) the tests whose name says `no_odp`, on the
# `odp` kernel all the others. A binary's tests that pass are checked against the list the
# binary gives of them, so a test that did not run fails the suite as a failed one does. Two
# binaries run at a time (RPMA_VM_LANES).
#
# Usage: suite.sh odp|stock LIST
#   LIST: lines "NAME EXECUTABLE PACKAGE_DIR" (scripts/vm-test.sh writes it from cargo).
# Each binary's output goes to $RPMA_VM_OUT/logs/KERNEL-NAME.log; the summary to stdout and to
# $RPMA_VM_OUT/KERNEL.summary.
set -uo pipefail

MODE="$1"
LIST="$2"
OUT="${RPMA_VM_OUT:?run under scripts/vm-run.sh}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
SUMMARY="$OUT/$MODE.summary"
: >"$SUMMARY"

case "$MODE" in
  stock) select=(no_odp) ;;
  odp) select=(--skip no_odp) ;;
  *) echo "suite: the kernel is odp or stock, not $MODE" >&2; exit 2 ;;
esac

# One binary: its ignored tests of this kernel, its log, and a result line
# "NAME LISTED PASSED FAILED STATUS SECONDS" in $RESULTS/NAME (nothing when it has none here).
RESULTS="$OUT/results-$MODE"
rm -rf "$RESULTS"
mkdir -p "$RESULTS"
run_one() {
  local name=$1 exe=$2 dir=$3 names listed log t0 status result passed failed
  if ! names=$(cd "$dir" && "$exe" --list --ignored "${select[@]}" 2>&1); then
    echo "$name: cannot list its tests: $names" >"$LOGS/$MODE-$name.log"
    echo "$name 1 0 0 1 0" >"$RESULTS/$name"
    return
  fi
  listed=$(grep -c ': test$' <<<"$names")
  [ "$listed" -gt 0 ] || return 0
  log="$LOGS/$MODE-$name.log"
  t0=$(date +%s)
  (cd "$dir" && timeout --kill-after=10 1200 "$exe" --ignored "${select[@]}") >"$log" 2>&1
  status=$?
  result=$(grep -E '^test result: ' "$log" | tail -1)
  passed=$(sed -n 's/.* \([0-9]*\) passed;.*/\1/p' <<<"$result")
  failed=$(sed -n 's/.* \([0-9]*\) failed;.*/\1/p' <<<"$result")
  echo "$name $listed ${passed:-0} ${failed:-0} $status $(($(date +%s) - t0))" >"$RESULTS/$name"
}

# Two binaries at a time (the guest's tests mostly wait: on a disk, a device, a peer), the
# longest first. They share no device: nbd and md are kernel_clients', loop devices
# fuse_mount's, nvme nvme_tcp_vm's, network namespaces roce_tshark's.
# ALONE: binaries that take the whole lab (rdma_device_loss deletes the RDMA device and adds
# it back), run last, one at a time, with nothing beside them.
LANES=${RPMA_VM_LANES:-2}
LONG="kernel_clients initiator_cli nvme_tcp_vm crash_consistency fuse_mount roce_tshark"
ALONE="rdma_device_loss"
start=$(date +%s)
{
  for n in $LONG; do grep "^$n " "$LIST"; done
  grep -v -E "^($(tr ' ' '|' <<<"$LONG $ALONE")) " "$LIST"
} | {
  while read -r name exe dir; do
    [ -n "$name" ] || continue
    while [ "$(jobs -rp | wc -l)" -ge "$LANES" ]; do wait -n; done
    run_one "$name" "$exe" "$dir" &
  done
  wait
}
for n in $ALONE; do
  grep "^$n " "$LIST" | while read -r name exe dir; do run_one "$name" "$exe" "$dir"; done
done
end=$(date +%s)

total_passed=0
total_failed=0
total_missing=0
for f in $(ls "$RESULTS" | sort); do
  read -r name listed passed failed status secs <"$RESULTS/$f"
  missing=$((listed - passed - failed))
  [ "$missing" -lt 0 ] && missing=0
  total_passed=$((total_passed + passed))
  total_failed=$((total_failed + failed))
  total_missing=$((total_missing + missing))
  printf '%-22s %3d passed %3d failed %3d not run  %4ds\n' "$name" "$passed" "$failed" "$missing" "$secs" |
    tee -a "$SUMMARY"
  if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$missing" -ne 0 ]; then
    # A binary that failed without failing a test (it could not list its tests, or died)
    # counts as a failure too.
    [ "$failed" -eq 0 ] && [ "$missing" -eq 0 ] && total_failed=$((total_failed + 1))
    [ "$status" -eq 124 ] && echo "    $name did not finish within 1200 s" | tee -a "$SUMMARY"
    # The failures and their output, as libtest prints them at the end.
    log="$LOGS/$MODE-$name.log"
    sed -n '/^failures:$/,$p' "$log" | head -200
    [ "$missing" -eq 0 ] && [ "$failed" -eq 0 ] && tail -30 "$log"
    # Each failed test by name with where it panicked and the panic's first line, into the
    # summary too: scripts/vm-test.sh repeats them last, where a log's tail is all one sees.
    awk -v bin="$name" '
      /^---- .* stdout ----$/ { t = $2; want = 0; next }
      t != "" && / panicked at / { sub(/.* panicked at /, ""); sub(/:$/, ""); at = $0; want = 1; next }
      want { printf "    FAILED %s %s at %s: %s\n", bin, t, at, substr($0, 1, 160); t = ""; want = 0 }
    ' "$log" | tee -a "$SUMMARY"
  fi
done

echo "suite ($MODE kernel $(uname -r)): $total_passed passed, $total_failed failed," \
  "$total_missing not run, in $((end - start)) s" | tee -a "$SUMMARY"
[ "$total_failed" -eq 0 ] && [ "$total_missing" -eq 0 ] && [ "$total_passed" -gt 0 ]
