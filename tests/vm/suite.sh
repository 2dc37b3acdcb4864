#!/bin/bash
# Inside a VM lab guest (after guest-lab.sh): runs the workspace's device tests, the ones that
# are `#[ignore]`d on the host because they need the real stack (Soft-RoCE, DAX, kernel block
# clients). Every ignored test of every test binary is run in one of the two guests, none is
# skipped: on the `stock` kernel (rxe without ODP) the tests whose name says `no_odp`, on the
# `odp` kernel all the others. A binary's tests that pass are checked against the list the
# binary gives of them, so a test that did not run fails the suite as a failed one does.
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

total_passed=0
total_failed=0
total_missing=0
start=$(date +%s)
while read -r name exe dir; do
  [ -n "$name" ] || continue
  # The ignored tests of this binary that this kernel runs.
  if ! names=$(cd "$dir" && "$exe" --list --ignored "${select[@]}" 2>&1); then
    echo "$name: cannot list its tests: $names" | tee -a "$SUMMARY"
    total_failed=$((total_failed + 1))
    continue
  fi
  listed=$(grep -c ': test$' <<<"$names")
  [ "$listed" -gt 0 ] || continue
  log="$LOGS/$MODE-$name.log"
  t0=$(date +%s)
  (cd "$dir" && timeout --kill-after=10 1200 "$exe" --ignored "${select[@]}") >"$log" 2>&1
  status=$?
  t1=$(date +%s)
  result=$(grep -E '^test result: ' "$log" | tail -1)
  passed=$(sed -n 's/.* \([0-9]*\) passed;.*/\1/p' <<<"$result")
  failed=$(sed -n 's/.* \([0-9]*\) failed;.*/\1/p' <<<"$result")
  passed=${passed:-0}
  failed=${failed:-0}
  missing=$((listed - passed - failed))
  total_passed=$((total_passed + passed))
  total_failed=$((total_failed + failed))
  [ "$missing" -gt 0 ] && total_missing=$((total_missing + missing))
  line=$(printf '%-22s %3d passed %3d failed %3d not run  %4ds' "$name" "$passed" "$failed" "$missing" $((t1 - t0)))
  echo "$line" | tee -a "$SUMMARY"
  if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$missing" -ne 0 ]; then
    [ "$status" -eq 124 ] && echo "    $name did not finish within 1200 s" | tee -a "$SUMMARY"
    # The failures and their output, as libtest prints them at the end.
    sed -n '/^failures:$/,$p' "$log" | head -200
    [ "$missing" -eq 0 ] && [ "$failed" -eq 0 ] && tail -30 "$log"
  fi
done <"$LIST"
end=$(date +%s)

echo "suite ($MODE kernel $(uname -r)): $total_passed passed, $total_failed failed," \
  "$total_missing not run, in $((end - start)) s" | tee -a "$SUMMARY"
[ "$total_failed" -eq 0 ] && [ "$total_missing" -eq 0 ] && [ "$total_passed" -gt 0 ]
