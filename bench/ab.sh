#!/usr/bin/env bash
# A/B of the initiator: one `rpma-initiator bench --job` section run by several variants in turn
# (interleaved, REPS rounds) against one rpma-target, so that the machine's drift falls on all
# of them alike. A variant is a directory holding an rpma-initiator, optionally followed by
# `+ARGS` (comma-separated arguments added to its bench command). One line per run:
# "VARIANT IOPS MiB/s p50_us"; then the medians. docs/benchmarks.md quotes its runs.
#
#   bench/ab.sh [options] VARIANT...
#     --reps N         rounds (default 5)
#     --job 'K=V ...'  the job section's options (default: rw=randwrite bs=4k iodepth=16)
#     --runtime S      seconds per run (default 3)
#     --target DIR     the rpma-target to use (default: the first variant's directory)
#     --nsid N         1: dax (forced) on /dev/shm (default); 2: a page-cache file
#     --set 'K = V'    a top-level line of the target's configuration (repeatable),
#                      e.g. --set 'crc = false' with variants DIR and DIR+--crc,off
#     --pin            the target alone on the last CPU, the initiator on the others
#                      (taskset), as on two machines: unpinned, the scheduler may leave both
#                      busy-polling ends on one CPU for seconds (docs/benchmarks.md)
#     --beside-export  keep an NBD export (rpma-initiator nbd, nsid 1) connected, idle, for
#                      the whole sitting, as bench/run.sh's matrix does: the target's loop then
#                      serves two connections
#
# Example: bench/ab.sh --job 'rw=write bs=1m iodepth=1' /tmp/bin /tmp/bin+--copy-writes
set -euo pipefail
cd "$(dirname "$0")/.."
reps=5 job='rw=randwrite bs=4k iodepth=16' runtime=3 tdir= nsid=1 pin=0 beside=0
sets=()
while [ $# -gt 0 ]; do
    case $1 in
        --reps) reps=$2; shift 2 ;;
        --job) job=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --target) tdir=$2; shift 2 ;;
        --nsid) nsid=$2; shift 2 ;;
        --set) sets+=("$2"); shift 2 ;;
        --pin) pin=1; shift ;;
        --beside-export) beside=1; shift ;;
        -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "bench/ab.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "bench/ab.sh: name at least one variant (a directory)" >&2; exit 2; }
for v in "$@"; do
    d=${v%%+*}
    [ -x "$d/rpma-initiator" ] || { echo "bench/ab.sh: no rpma-initiator in $d" >&2; exit 2; }
done
tdir=${tdir:-${1%%+*}}
[ -x "$tdir/rpma-target" ] || { echo "bench/ab.sh: no rpma-target in $tdir" >&2; exit 2; }
export RPMA_BENCH_BIN=$tdir
. scripts/local-target.sh
local_setup ab
bench_config
# Top-level settings go before the first table.
for l in "${sets[@]}"; do sed -i "1i $l" "$SCRATCH/target.toml"; done
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"
client=()
[ "$pin" = 1 ] && pin_target bench/ab.sh
if [ "$beside" = 1 ]; then
    # Started directly (not in a subshell), so that the EXIT trap's kill reaches the export.
    "${client[@]}" "$tdir/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" \
        --nsid 1 nbd --socket "$SCRATCH/beside.sock" --export beside >/dev/null &
    beside_pid=$!
    trap 'kill "$beside_pid" 2>/dev/null; wait "$beside_pid" 2>/dev/null; local_cleanup' EXIT
    for _ in $(seq 100); do [ -S "$SCRATCH/beside.sock" ] && break; sleep 0.1; done
    [ -S "$SCRATCH/beside.sock" ] || { echo "bench/ab.sh: the export did not start" >&2; exit 1; }
fi
{
    printf '[global]\nsize=64m\noffset=0\ntime_based=1\nruntime=%s\n[ab]\n' "$runtime"
    tr ' ' '\n' <<<"$job"
} >"$SCRATCH/ab.fio"
echo "# $(date -u +%FT%TZ), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
pinned=
[ "$pin" = 1 ] && pinned=", pinned: target on CPU $last, initiator on the others"
[ "$beside" = 1 ] && pinned="$pinned, an idle NBD export's connection beside"
echo "# job: $job, ${runtime}s, nsid $nsid; target: $tdir${sets[*]:+ (${sets[*]})}$pinned"
: >"$SCRATCH/runs"
for _ in $(seq "$reps"); do
    for v in "$@"; do
        d=${v%%+*}
        extra=()
        [ "$v" = "$d" ] || IFS=, read -r -a extra <<<"${v#*+}"
        "${client[@]}" "$d/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" \
            --nsid "$nsid" bench --job "$SCRATCH/ab.fio" --output-format json "${extra[@]}" \
            >"$SCRATCH/out.json"
        python3 - "$v" "$SCRATCH/out.json" <<'EOF' | tee -a "$SCRATCH/runs"
import json, sys
j = json.load(open(sys.argv[2]))["jobs"][0]
x = j["write"] if j["write"]["io_bytes"] else j["read"]
p50 = x["clat_ns"]["percentile"]["50.000000"] / 1000
print(f"{sys.argv[1]} {x['iops']:.0f} {x['bw'] / 1024:.1f} {p50:.1f}")
EOF
    done
done
python3 - "$SCRATCH/runs" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    v, *f = line.split()
    runs.setdefault(v, []).append([float(x) for x in f])
print("# medians: variant IOPS MiB/s p50_us")
for v, rs in runs.items():
    print(v, *(f"{statistics.median(r[i] for r in rs):.1f}" for i in range(3)))
EOF
