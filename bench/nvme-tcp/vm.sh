#!/bin/bash
# The side-by-side of rpma-target's nvme-tcp:// listener and Linux's nvmet, in a VM lab guest
# (scripts/vm-run.sh; scripts/vm-setup.sh first): the kernel's NVMe/TCP host drives both. Results
# (fio JSON, summary.md) go to bench/results/nvme-tcp/. Under TCG emulation only the ratios
# mean anything (docs/benchmarks.md, "NVMe/TCP: rpma-target and nvmet side by side").
#
#   bench/nvme-tcp/vm.sh [RUNTIME-SECONDS [REPS]]     (scripts/vm-run.sh's environment)
set -euo pipefail
cd "$(dirname "$0")/../.."
runtime=${1:-10}
reps=${2:-2}
cargo build --quiet --release -p rpma-target
out=$PWD/bench/results/nvme-tcp
rm -rf "$out" && mkdir -p "$out"
{ echo "host: $(uname -r)"; grep -m1 'model name' /proc/cpuinfo; nproc; echo "load before: $(cat /proc/loadavg)"; git rev-parse --short HEAD; } \
    > "$out/machine.txt"
RPMA_VM_OUT="$out" bash scripts/vm-run.sh --timeout 3600 -- \
    bash "$PWD/bench/nvme-tcp/guest.sh" "$PWD" "$out" "$runtime" "$reps" > "$out/console.log" 2>&1 || true
echo "load after: $(cat /proc/loadavg)" >> "$out/machine.txt"
cat "$out/summary.md"
