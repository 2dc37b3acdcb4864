#!/usr/bin/env bash
# A/B of the NBD export: one rpma-target (from the first variant's directory) and one
# `rpma-initiator nbd` per variant (each its own binary, on nsid 1: dax forced on /dev/shm), with
# nbdkit's file plugin on a /dev/shm file beside them as the peer; fio's nbd engine runs one job
# section on each in turn (interleaved, REPS rounds). One line per run: "NAME IOPS MiB/s p50_us"
# (p50 of the slower direction; with fsync=1 a write's p50 plus its FLUSH's, as bench/report.py
# adds them); then the medians. docs/benchmarks.md quotes its runs.
#
#   bench/nbd-ab.sh [--reps N] [--job 'K=V ...'] [--runtime S] [--proxy] DIR...
#     --reps N         rounds (default 5)
#     --job 'K=V ...'  the job section's options (default: rw=randread bs=4k iodepth=16)
#     --runtime S      seconds per run after a 1 s ramp (default 3)
#     --proxy          two more peers. nbdkit-proxy: nbdkit's nbd plugin on a unix socket,
#                      relaying over loopback TCP to a second nbdkit file plugin on the same
#                      file; the shape of the export's path (fio, a relay, TCP, the server
#                      holding the memory) with third-party code in both places; and
#                      socat-relay: socat relaying the unix socket's bytes to that TCP
#                      server, a relay that does nothing but copy (scripts/install-deps.sh)
#     --pin            the target alone on the last CPU, every export and fio on the others
#                      (taskset; nbdkit and the relays left to the scheduler): the target with
#                      a CPU of its own, as on a storage host, and the export beside its client
#
# Example: bench/nbd-ab.sh --reps 9 --job 'rw=randread bs=4k iodepth=1' /tmp/old /tmp/new
set -euo pipefail
cd "$(dirname "$0")/.."
reps=5 job='rw=randread bs=4k iodepth=16' runtime=3 proxy=0 pin=0
while [ $# -gt 0 ]; do
    case $1 in
        --reps) reps=$2; shift 2 ;;
        --job) job=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --proxy) proxy=1; shift ;;
        --pin) pin=1; shift ;;
        -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "bench/nbd-ab.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "bench/nbd-ab.sh: name at least one variant (a directory)" >&2; exit 2; }
for d in "$@"; do
    [ -x "$d/rpma-initiator" ] || { echo "bench/nbd-ab.sh: no rpma-initiator in $d" >&2; exit 2; }
done
[ -x "$1/rpma-target" ] || { echo "bench/nbd-ab.sh: no rpma-target in $1" >&2; exit 2; }
for tool in fio nbdkit; do
    command -v "$tool" >/dev/null || {
        echo "bench/nbd-ab.sh: $tool is missing (scripts/install-deps.sh installs it)" >&2
        exit 1
    }
done
export RPMA_BENCH_BIN=$1
. scripts/local-target.sh
local_setup nbdab
bench_config
# 512-byte blocks, as bench/matrix.sh (lat.fio-style 512 B requests stay valid).
sed -i 's/^size = "128MiB"$/&\nblock_size = 512/' "$SCRATCH/target.toml"
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"
client=()
[ "$pin" = 1 ] && pin_target bench/nbd-ab.sh
peer=/dev/shm/rpma-nbdab-peer-$$.img
pids=()
nbdab_cleanup() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -f "$peer"
    local_cleanup
}
trap nbdab_cleanup EXIT
fallocate -l 128MiB "$peer"
nbdkit --foreground --exit-with-parent --unix "$SCRATCH/nbdkit.sock" file "$peer" &
pids+=($!)
names=(nbdkit-shm) uris=("nbd+unix:///?socket=$SCRATCH/nbdkit.sock") i=0
if [ "$proxy" = 1 ]; then
    # The relay's upstream on a free loopback port (free_port probes 7420-7520; the target
    # holds URL's, so the probe after it finds another).
    target_url=$URL
    free_port
    port=${URL##*:}
    URL=$target_url
    nbdkit --foreground --exit-with-parent -i 127.0.0.1 -p "$port" file "$peer" &
    pids+=($!)
    nbdkit --foreground --exit-with-parent --unix "$SCRATCH/proxy.sock" \
        nbd hostname=127.0.0.1 port="$port" &
    pids+=($!)
    names+=(nbdkit-proxy) uris+=("nbd+unix:///?socket=$SCRATCH/proxy.sock")
    command -v socat >/dev/null || {
        echo "bench/nbd-ab.sh: socat is missing (scripts/install-deps.sh installs it)" >&2
        exit 1
    }
    # Its largest buffer (socat's default is 8 KiB a read), so 1 MiB requests move in big reads.
    socat -b 1048576 UNIX-LISTEN:"$SCRATCH/relay.sock",fork TCP:127.0.0.1:"$port",nodelay &
    pids+=($!)
    names+=(socat-relay) uris+=("nbd+unix:///?socket=$SCRATCH/relay.sock")
fi
for d in "$@"; do
    i=$((i + 1))
    "${client[@]}" "$d/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" \
        --nsid 1 nbd --socket "$SCRATCH/v$i.sock" --export dax >/dev/null 2>&1 &
    pids+=($!)
    names+=("$d") uris+=("nbd+unix:///dax?socket=$SCRATCH/v$i.sock")
done
for u in "${uris[@]}"; do
    s=${u#*socket=}
    for _ in $(seq 100); do [ -S "$s" ] && break; sleep 0.1; done
    [ -S "$s" ] || { echo "bench/nbd-ab.sh: $s did not appear" >&2; exit 1; }
done
echo "# $(date -u +%FT%TZ), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "# job: $job, ${runtime}s$([ "$pin" = 1 ] && echo ", pinned: target on CPU $last, exports and fio on the others")"
: >"$SCRATCH/runs"
for _ in $(seq "$reps"); do
    for v in "${!names[@]}"; do
        {
            # group_reporting: with numjobs=N, fio's first job is all N jobs' sum.
            printf '[global]\nioengine=nbd\nuri=%s\nsize=64m\noffset=0\ntime_based=1\n' "${uris[$v]}"
            printf 'group_reporting=1\n'
            printf 'runtime=%s\nramp_time=1\n[ab]\n' "$runtime"
            tr ' ' '\n' <<<"$job"
        } >"$SCRATCH/ab.fio"
        "${client[@]}" fio --output-format=json --output="$SCRATCH/out.json" "$SCRATCH/ab.fio" >/dev/null
        python3 - "${names[$v]}" "$SCRATCH/out.json" <<'PY' | tee -a "$SCRATCH/runs"
import json, sys
j = json.load(open(sys.argv[2]))['jobs'][0]
iops = mib = 0.0
p50 = []
for k in ('read', 'write'):
    x = j[k]
    if x['io_bytes']:
        iops += x['iops']
        mib += x['bw'] / 1024
        p = x['clat_ns']['percentile']['50.000000']
        # fsync=1: fio times each FLUSH apart (sync); a durable write is both (as report.py).
        if k == 'write' and j.get('sync', {}).get('total_ios', 0) > 0:
            p += j['sync']['lat_ns']['percentile']['50.000000']
        p50.append(p / 1000)
print(sys.argv[1], '%.0f' % iops, '%.1f' % mib, '%.1f' % max(p50))
PY
    done
done
echo "# medians: variant IOPS MiB/s p50_us"
python3 - "$SCRATCH/runs" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    n, *v = line.split()
    runs.setdefault(n, []).append([float(x) for x in v])
for n, v in runs.items():
    print(n, *('%.1f' % statistics.median(r[i] for r in v) for i in range(3)))
PY
