#!/bin/bash
# The side-by-side of rpma-target's nvme-tcp:// listener and Linux's nvmet, in a guest booted
# with virtme-ng on this machine's userspace (the kernel's NVMe/TCP host drives both). Results
# (fio JSON, summary.md) go to bench/results/nvme-tcp/. Under TCG emulation only the ratios
# mean anything (docs/benchmarks.md, "NVMe/TCP: rpma-target and nvmet side by side").
#
#   bench/nvme-tcp/vm.sh [RUNTIME-SECONDS [REPS]]     (env: VM_KERNEL, VNG_VENV, VM_CPUS, VM_MEMORY)
set -euo pipefail
cd "$(dirname "$0")/../.."
VNG_VENV=${VNG_VENV:-/tmp/vngvenv}
VM_KERNEL=${VM_KERNEL:-/tmp/kapt/root/usr/lib/modules/7.3.4+deb13-amd64/vmlinuz}
export PATH="$VNG_VENV/bin:$PATH"
runtime=${1:-10}
reps=${2:-2}
cargo build --quiet --release -p rpma-target
out=$PWD/bench/results/nvme-tcp
rm -rf "$out" && mkdir -p "$out"
{ echo "host: $(uname -r)"; grep -m1 'model name' /proc/cpuinfo; nproc; echo "load before: $(cat /proc/loadavg)"; git rev-parse --short HEAD; } \
    > "$out/machine.txt"
timeout 3600 vng --run "$VM_KERNEL" --disable-kvm --cpus "${VM_CPUS:-2}" \
    --memory "${VM_MEMORY:-6G}" --rwdir "$out=$out" \
    --exec "bash $PWD/bench/nvme-tcp/guest.sh $PWD $out $runtime $reps" > "$out/console.log" 2>&1 || true
echo "load after: $(cat /proc/loadavg)" >> "$out/machine.txt"
cat "$out/summary.md"
