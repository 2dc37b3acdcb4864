#!/usr/bin/env bash
# Where a QD1 round trip's time goes: the raw-TCP floor, the transport alone (fabric_bench) and
# the product (rpma-initiator bench against rpma-target), each recorded the same way and split
# by bench/rt_split.py into, per side, the user-space work between receiving a message and
# sending its answer (with the symbols it is spent in), the send system call, and the hand-over
# to the other side. A measurement for docs/benchmarks.md, not a test.
#
#   bench/rt-split.sh [options] BIN
#     BIN              a directory with rpma-target, rpma-initiator and examples/fabric_bench
#                      (release builds)
#     --job 'K=V ...'  the product's job (default: rw=randread bs=4k iodepth=1)
#     --nsid N         1: dax (forced) on /dev/shm (default); 2: a page-cache file
#     --case TEXT      fabric_bench's case (default: crc on, ulpdu default (MSS), dax (forced));
#                      "none" skips it
#     --seconds S      how long each recording lasts (default 2)
#     --top N          symbols shown per side (default 12)
#
# Needs perf with the syscalls tracepoints (root). The recording costs each system call a
# little; the floor pays it too, so compare within one run. It also slows memory-bound code
# more than the rest (a 4 KiB placement with non-temporal stores: 0.84 us recorded, 0.25 us
# timed in place; docs/benchmarks.md): time a part in place before acting on its share.
set -euo pipefail
cd "$(dirname "$0")/.."
job='rw=randread bs=4k iodepth=1' nsid=1 case='crc on, ulpdu default (MSS), dax (forced)'
secs=2 top=12
while [ $# -gt 0 ]; do
    case $1 in
        --job) job=$2; shift 2 ;;
        --nsid) nsid=$2; shift 2 ;;
        --case) case=$2; shift 2 ;;
        --seconds) secs=$2; shift 2 ;;
        --top) top=$2; shift 2 ;;
        -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "bench/rt-split.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# -eq 1 ] || { echo "bench/rt-split.sh: name one directory of binaries" >&2; exit 2; }
bin=$(cd "$1" && pwd)
for f in rpma-target rpma-initiator examples/fabric_bench; do
    [ -x "$bin/$f" ] || { echo "bench/rt-split.sh: no $f in $bin" >&2; exit 2; }
done
command -v perf >/dev/null || { echo "bench/rt-split.sh: needs perf" >&2; exit 2; }
export RPMA_BENCH_BIN=$bin
. scripts/local-target.sh
local_setup rtsplit
PERIOD=40009
EVENTS=cpu-clock:u
for s in recvfrom writev sendmsg sendto; do
    EVENTS+=",syscalls:sys_enter_$s,syscalls:sys_exit_$s"
done

# record NAME PIDS: records PIDS (comma-separated) for $secs seconds and splits the result.
record() {
    local name=$1 pids=$2
    perf record -q -m 8192 -c "$PERIOD" -e "$EVENTS" -p "$pids" -o "$SCRATCH/$name.data" \
        -- sleep "$secs" >/dev/null 2>&1
    perf script --ns -F tid,time,event,ip,sym,trace -i "$SCRATCH/$name.data" \
        >"$SCRATCH/$name.txt" 2>/dev/null
    echo
    echo "## $name"
    python3 bench/rt_split.py "$SCRATCH/$name.txt" "$PERIOD" "$top"
}

# fabric WHAT ARGS...: fabric_bench in the background, recorded from 0.5 s in (its QD1
# ping-pong comes first and outlasts the recording), then stopped; the /dev/shm files it had
# open (its regions, which a stopped process leaves behind) are removed.
fabric() {
    local name=$1
    shift
    "$bin/examples/fabric_bench" --reps 1 --iters 2000000 --gib 1 "$@" >"$SCRATCH/$name.out" 2>&1 &
    local pid=$!
    sleep 0.5
    record "$name" "$pid"
    local left
    left=$(find "/proc/$pid/fd" -lname '/dev/shm/rpma-fabric-bench-*' -printf '%l\n' 2>/dev/null || true)
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    [ -z "$left" ] || xargs rm -f <<<"$left"
}

echo "# $(date -u +%FT%TZ), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "# flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|vpclmulqdq|clwb|clflushopt)$' | xargs)"
echo "# product: $job, nsid $nsid; transport alone: ${case}; bins: $bin"
# "floor" names no case of fabric_bench's: the floor alone.
fabric "floor: raw TCP ping-pong (4 KiB one way, 8 B back)" --only floor
if [ "$case" != none ]; then
    fabric "transport alone: $case (a 4 KiB Write and an 8 B Read per round trip)" --no-floor --only "$case"
fi

bench_config
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"
{
    printf '[global]\nsize=64m\noffset=0\ntime_based=1\nruntime=%s\n[rt]\n' "$((secs + 3))"
    tr ' ' '\n' <<<"$job"
} >"$SCRATCH/rt.fio"
"$bin/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" --nsid "$nsid" \
    bench --job "$SCRATCH/rt.fio" >"$SCRATCH/product.out" 2>&1 &
init_pid=$!
sleep 1.5
record "product: $job, nsid $nsid" "$target_pid,$init_pid"
wait "$init_pid"
