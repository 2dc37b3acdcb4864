#!/bin/bash
# Runs in the VM lab's guest (bench/nvme-tcp/vm.sh boots it): the same fio jobs (jobs.fio) on
# the kernel's NVMe/TCP host against rpma-target's nvme-tcp:// listener and against Linux's own
# nvmet, each serving a 768 MiB file on the same ext4 (on a RAM disk, so page-cache on both:
# rpma-target maps it, nvmet with buffered_io=1), over loopback, two I/O queues, no digests.
# Writes fio's JSON per backend and repetition (alternating), and a table of the medians of the
# two and their ratio, to $OUT.
#
#   guest.sh REPO OUT RUNTIME REPS
set -euo pipefail
REPO=$1 OUT=$2 RUNTIME=${3:-10} REPS=${4:-2}
SUB=nqn.2026-11.io.rpma:bench
HOSTNQN=nqn.2026-11.io.rpma:bench-host
ip link set lo up
modprobe nvme-tcp
modprobe nvmet
modprobe nvmet-tcp
# The lab's scratch ext4 (tests/vm/guest-lab.sh: a RAM disk) holds both files.
FS="${RPMA_TEST_SCRATCH:?run under scripts/vm-run.sh}/nvme-bench"
mkdir -p "$FS"
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config

dev_of() {  # the block device of subsystem $1
    for d in /sys/class/nvme-subsystem/*; do
        [ "$(cat "$d/subsysnqn")" = "$1" ] || continue
        for n in "$d"/nvme*n*; do b=$(basename "$n"); case $b in *c*) ;; *) echo "/dev/$b"; return;; esac; done
    done
}

run_fio() {  # backend name
    local dev=""
    for _ in $(seq 100); do dev=$(dev_of $SUB); [ -n "$dev" ] && [ -b "$dev" ] && break; sleep 0.2; done
    [ -b "$dev" ] || { echo "no block device for $SUB" >&2; exit 1; }
    # Every block written once first, so reads read data on both.
    fio --name=prefill --filename="$dev" --rw=write --bs=1m --size=512m --direct=1 \
        --ioengine=libaio --iodepth=8 --output=/dev/null
    DEV=$dev RUNTIME=$RUNTIME fio --output-format=json --output="$OUT/$1.json" \
        "$REPO/bench/nvme-tcp/jobs.fio"
}

bench_rpma() {  # rep
    mkdir -p /tmp/rpma
    cat > /tmp/rpma/target.toml <<EOT
listen = ["nvme-tcp://127.0.0.1:4420"]
control_socket = "/tmp/rpma/ctl.sock"
[[subsystem]]
nqn = "$SUB"
hosts = [{ nqn = "$HOSTNQN" }]
[[subsystem.namespace]]
nsid = 1
path = "$FS/rpma.img"
size = "768MiB"
EOT
    RUST_LOG=warn "$REPO/build/release/rpma-target" --config /tmp/rpma/target.toml \
        2>> "$OUT/rpma-target.log" &
    local tp=$!
    for _ in $(seq 100); do [ -S /tmp/rpma/ctl.sock ] && break; sleep 0.1; done
    nvme connect -t tcp -a 127.0.0.1 -s 4420 -n $SUB -q $HOSTNQN -i 2
    run_fio rpma-target-$1
    nvme disconnect -n $SUB
    kill $tp; wait $tp || true
}

nvmet_setup() {  # the same file size on the same filesystem, page cache (buffered_io)
    truncate -s 768M $FS/nvmet.img
    fallocate -l 768M $FS/nvmet.img
    cd /sys/kernel/config/nvmet
    mkdir subsystems/$SUB
    echo 0 > subsystems/$SUB/attr_allow_any_host
    mkdir hosts/$HOSTNQN
    ln -s /sys/kernel/config/nvmet/hosts/$HOSTNQN subsystems/$SUB/allowed_hosts/
    mkdir subsystems/$SUB/namespaces/1
    echo $FS/nvmet.img > subsystems/$SUB/namespaces/1/device_path
    echo 1 > subsystems/$SUB/namespaces/1/buffered_io
    mkdir ports/1
    echo 127.0.0.1 > ports/1/addr_traddr
    echo tcp > ports/1/addr_trtype
    echo 4421 > ports/1/addr_trsvcid
    echo ipv4 > ports/1/addr_adrfam
    ln -s /sys/kernel/config/nvmet/subsystems/$SUB ports/1/subsystems/
    cd /
}

bench_nvmet() {  # rep
    echo 1 > /sys/kernel/config/nvmet/subsystems/$SUB/namespaces/1/enable
    nvme connect -t tcp -a 127.0.0.1 -s 4421 -n $SUB -q $HOSTNQN -i 2
    run_fio nvmet-$1
    nvme disconnect -n $SUB
    echo 0 > /sys/kernel/config/nvmet/subsystems/$SUB/namespaces/1/enable
}

# Alternating, so that a change of the host's load meanwhile falls on both.
nvmet_setup
for rep in $(seq "$REPS"); do
    bench_rpma "$rep"
    bench_nvmet "$rep"
done

python3 - "$OUT" "$REPS" <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
def load(b):
    runs = [{j["jobname"]: j for j in json.load(open(f"{out}/{b}-{r}.json"))["jobs"]}
            for r in range(1, reps + 1)]
    return runs
r = {b: load(b) for b in ("rpma-target", "nvmet")}
print(f"medians of {reps} alternating runs; latency: fio's lat (submission to completion), mean")
print()
print("| job | rpma-target IOPS | nvmet IOPS | ratio | rpma-target lat us | nvmet lat us |")
print("|---|---:|---:|---:|---:|---:|")
for name in r["rpma-target"][0]:
    side = "write" if "write" in name else "read"
    iops = {b: statistics.median(x[name][side]["iops"] for x in r[b]) for b in r}
    lat = {b: statistics.median(x[name][side]["lat_ns"]["mean"] for x in r[b]) / 1000 for b in r}
    a, b = iops["rpma-target"], iops["nvmet"]
    print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f} | {lat['rpma-target']:.0f} | {lat['nvmet']:.0f} |")
PY
