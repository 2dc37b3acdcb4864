#!/usr/bin/env bash
# Runs a command in a VM lab guest (docs/testing.md): a Debian kernel booted by virtme-ng on
# this machine's own userspace (the host's / read-only over 9p, tmpfs overlays on /etc /usr
# /var /tmp ...), with the lab set up by tests/vm/guest-lab.sh before the command runs:
# Soft-RoCE (rxe0 on dummy0, 10.99.0.1), emulated persistent memory as an fsdax ext4 mounted
# -o dax and a devdax device, a scratch ext4 (page cache) on a RAM disk, memlock unlimited.
# The command's exit status comes back. Run scripts/vm-setup.sh first (make vm-test does).
#
# Usage: scripts/vm-run.sh [--kernel odp|stock] [--timeout SECONDS] [--] COMMAND [ARG...]
#   --kernel odp    Debian trixie-backports' 7.x kernel: rxe with on-demand paging (default)
#   --kernel stock  Debian 12's 6.1 kernel: rxe without ODP
#   --kernel NAME   any other kernel unpacked under the lab's kernels/NAME (vm-setup.sh)
#   --timeout S     kill the guest after S seconds (default 1800) and fail
# Environment: RPMA_VM_ACCEL=kvm|tcg overrides the accelerator choice; RPMA_VMLAB_DIR the lab's
# directory (default build/vmlab); RPMA_VM_CPUS (2) and RPMA_VM_MEMORY (6G); RPMA_VM_OUT, a host
# directory the guest may write (mounted read-write at the same path), default $LAB/out;
# RPMA_VM_BOOT_WAIT (300): a guest that has not started the command within that many seconds
# hung in its boot (seen under TCG: qemu busy, nothing printed) and is killed (exit 125).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LAB="${RPMA_VMLAB_DIR:-$ROOT/build/vmlab}"
KERNEL=odp
TIMEOUT=1800

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --kernel) KERNEL="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "vm-run: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { usage >&2; exit 2; }

IMAGE="$LAB/kernels/$KERNEL/vmlinuz"
VNG="$LAB/venv/bin/vng"
for f in "$IMAGE" "$VNG"; do
  [ -e "$f" ] || { echo "vm-run: $f is missing: run scripts/vm-setup.sh first" >&2; exit 2; }
done

# KVM where it can run a stock kernel, TCG (emulation) where it cannot, and say which and why.
accel_args=()
choose_accel() {
  case "${RPMA_VM_ACCEL:-}" in
    kvm) echo "vm-run: KVM (RPMA_VM_ACCEL=kvm)" >&2; return ;;
    tcg) echo "vm-run: TCG emulation (RPMA_VM_ACCEL=tcg)" >&2; accel_args=(--disable-kvm); return ;;
    "") ;;
    *) echo "vm-run: RPMA_VM_ACCEL is kvm or tcg" >&2; exit 2 ;;
  esac
  if [ ! -c /dev/kvm ] || [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
    echo "vm-run: TCG emulation: no usable /dev/kvm (slow: compare ratios, not times)" >&2
    accel_args=(--disable-kvm)
  elif [ -d /sys/module/kvm_pvm ]; then
    echo "vm-run: TCG emulation: /dev/kvm is kvm-pvm, which cannot boot a stock kernel" \
      "(it hangs after 'Probing EDD'; slow: compare ratios, not times)" >&2
    accel_args=(--disable-kvm)
  elif [ -d /sys/module/kvm_intel ] || [ -d /sys/module/kvm_amd ]; then
    echo "vm-run: KVM (/dev/kvm with $(ls -d /sys/module/kvm_intel /sys/module/kvm_amd 2>/dev/null | xargs -n1 basename))" >&2
  else
    echo "vm-run: TCG emulation: /dev/kvm is neither kvm_intel nor kvm_amd (slow: compare ratios, not times)" >&2
    accel_args=(--disable-kvm)
  fi
}
choose_accel

OUT="${RPMA_VM_OUT:-$LAB/out}"
mkdir -p "$OUT"

# The command travels as a script in the lab's directory (the guest sees it over 9p).
RUN_DIR="$(mktemp -d "$LAB/run.XXXXXX")"
MARK="$OUT/.booted.$(basename "$RUN_DIR")"
trap 'rm -rf "$RUN_DIR"; rm -f "$MARK"' EXIT
{
  echo "#!/bin/bash"
  echo "cd $(printf '%q' "$PWD")"
  # What the guest should see of this shell's environment: the caller's RPMA_* and RUST_*.
  env | grep -E '^(RPMA_|RUST_LOG=|RUST_BACKTRACE=)' | grep -v -E '^RPMA_VM(_ACCEL|LAB_DIR)=' |
    while IFS='=' read -r k v; do echo "export $k=$(printf '%q' "$v")"; done
  echo "export RPMA_VM_KERNEL=$KERNEL RPMA_VM_OUT=$(printf '%q' "$OUT")"
  # The guest's first act: the mark that it booted (OUT is the one directory it may write).
  echo ": >$(printf '%q' "$MARK")"
  printf 'exec %q' "$ROOT/tests/vm/guest-lab.sh"
  printf ' %q' "$@"
  echo
} >"$RUN_DIR/cmd.sh"
chmod +x "$RUN_DIR/cmd.sh"

# memmap=SIZE!OFFSET: two ranges of guest RAM reported as legacy persistent memory (region0
# for fsdax, region1 for devdax). They must lie in RAM below the PCI hole (under 2 GiB here):
# a range beyond RAM is accepted and silently loses writes.
export PATH="$LAB/venv/bin:$PATH"
status=0
timeout --kill-after=10 "$TIMEOUT" "$VNG" --run "$IMAGE" "${accel_args[@]}" \
  --cpus "${RPMA_VM_CPUS:-2}" --memory "${RPMA_VM_MEMORY:-6G}" \
  --append 'memmap=512M!1G' --append 'memmap=256M!1536M' \
  --rwdir="$OUT" --exec "$RUN_DIR/cmd.sh" </dev/null &
vm=$!
# Until the guest has left its mark, a boot that takes longer than BOOT_WAIT is one that hung:
# timeout's process group (vng, qemu) is killed, and the caller may boot again (vm-test.sh
# boots a guest up to three times) instead of waiting out --timeout. A boot takes ~20 s here, a minute when loaded.
BOOT_WAIT="${RPMA_VM_BOOT_WAIT:-300}"
t0=$(date +%s)
hung=0
while [ ! -e "$MARK" ] && kill -0 "$vm" 2>/dev/null; do
  if [ $(($(date +%s) - t0)) -ge "$BOOT_WAIT" ]; then
    echo "vm-run: the guest did not start its command within $BOOT_WAIT s (its boot hung): killed" >&2
    hung=1
    kill -TERM -- "-$vm" 2>/dev/null || kill -TERM "$vm" 2>/dev/null || true
    break
  fi
  sleep 1
done
wait "$vm" || status=$?
if [ "$hung" -eq 1 ]; then
  exit 125
fi
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "vm-run: the guest did not finish within $TIMEOUT s: killed" >&2
fi
exit "$status"
