#!/usr/bin/env bash
# bench/matrix.sh QUICK REPS OUT: the fio matrix of bench/run.sh (see there and bench/README.md).
# Run from the repo root by bench/run.sh. Starts a local rpma-target (nsid 1: /dev/shm, force_dax;
# nsid 2: a file under scratch/, page-cache), rpma-initiator nbd on nsid 1, and nbdkit's file
# plugin on a /dev/shm file and on a file under scratch/; everything is stopped and removed on exit.
set -euo pipefail
quick=$1 reps=$2 out=$3

for tool in fio nbdkit python3; do
    command -v "$tool" >/dev/null || {
        echo "bench: $tool is missing (scripts/install-deps.sh installs it)" >&2
        exit 1
    }
done

if [ "$quick" = 1 ]; then runtime=1 ramp=0; else runtime=5 ramp=1; fi
begin=$(date +%s)

# shellcheck source=scripts/local-target.sh
. scripts/local-target.sh
local_setup matrix
[ -n "${RPMA_BENCH_BIN:-}" ] || cargo build --quiet --release -p rpma-common --example fabric_bench
# Checked before the hour of fio, not after it: the floor is what every ratio is judged by.
if [ ! -x "$BIN/examples/fabric_bench" ]; then
    echo "bench: $BIN/examples/fabric_bench is missing (with --bin DIR: DIR/examples/fabric_bench)" >&2
    exit 1
fi
bench_config
# 512-byte blocks on both namespaces, as nbdkit's file plugin: the NBD export refuses requests
# not aligned to its block size (EINVAL), and lat.fio writes 512 B.
sed -i 's/^size = "128MiB"$/&\nblock_size = 512/' "$SCRATCH/target.toml"
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"

peer_shm=/dev/shm/rpma-matrix-peer-$$.img
pids=()
matrix_cleanup() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -f "$peer_shm"
    local_cleanup
}
trap matrix_cleanup EXIT

# The peer's files: the same size as rpma's namespaces, allocated up front as the target does.
fallocate -l 128MiB "$peer_shm"
fallocate -l 128MiB "$SCRATCH/peer.img"
nbdkit --foreground --exit-with-parent --unix "$SCRATCH/nbdkit-shm.sock" file "$peer_shm" &
nbdkit_shm=$!
pids+=("$nbdkit_shm")
nbdkit --foreground --exit-with-parent --unix "$SCRATCH/nbdkit-disk.sock" file "$SCRATCH/peer.img" &
nbdkit_disk=$!
pids+=("$nbdkit_disk")
ini() { "$BIN/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" "$@"; }
# Started directly, not through ini(): a function run in the background is a subshell, whose
# pid is not the export's (its CPU would not be measured and SIGTERM would not reach it).
"$BIN/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" \
    --nsid 1 nbd --socket "$SCRATCH/rpma-nbd.sock" --export dax >/dev/null &
rpma_nbd=$!
pids+=("$rpma_nbd")
for s in nbdkit-shm nbdkit-disk rpma-nbd; do
    for _ in $(seq 100); do [ -S "$SCRATCH/$s.sock" ] && break; sleep 0.1; done
    [ -S "$SCRATCH/$s.sock" ] || { echo "bench: $s did not start" >&2; exit 1; }
done

mkdir -p "$out"
rm -rf "$out/json" "$out/cpu.tsv"
mkdir -p "$out/json"
clk=$(getconf CLK_TCK)
# CPU seconds (user + system) the processes used so far.
cpu() { local p t=0; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }
secs() { awk -v t="$1" -v c="$clk" 'BEGIN {printf "%.3f\n", t / c}'; }

{
    echo "Machine: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $(nproc) CPUs;" \
        "flags (those that matter here): $(sed -n 's/^flags\s*: //p' /proc/cpuinfo | head -1 | tr ' ' '\n' |
            grep -E '^(clwb|clflushopt|avx512f|avx2|sse4_2|pclmulqdq|vpclmulqdq)$' | tr '\n' ' ')"
    echo "Kernel $(uname -r); $(date -u +%Y-%m-%dT%H:%MZ); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "Command: bench/run.sh$([ "$quick" = 1 ] && echo ' --quick') --reps $reps" \
        "(each job section ${runtime} s after ${ramp} s ramp, $reps repetition(s))"
} >"$out/machine.txt"
cat "$out/machine.txt"

# Idle: every server up and connected, nothing asked of them, 10 s.
echo "idle CPU over 10 s..."
i0=$(cpu "$target_pid"); n0=$(cpu "$target_pid" "$rpma_nbd")
s0=$(cpu "$nbdkit_shm"); d0=$(cpu "$nbdkit_disk")
sleep 10
{
    echo "rpma-dax idle 1 $(secs $(($(cpu "$target_pid") - i0)))"
    echo "rpma-disk idle 1 $(secs $(($(cpu "$target_pid") - i0)))"
    echo "rpma-nbd-dax idle 1 $(secs $(($(cpu "$target_pid" "$rpma_nbd") - n0)))"
    echo "nbdkit-shm idle 1 $(secs $(($(cpu "$nbdkit_shm") - s0)))"
    echo "nbdkit-disk idle 1 $(secs $(($(cpu "$nbdkit_disk") - d0)))"
} >>"$out/cpu.tsv"

# The job files with this run's runtime and ramp.
mkdir -p "$SCRATCH/jobs"
files=(lat iops bw mixed)
for f in "${files[@]}"; do
    sed -e "s/^runtime=.*/runtime=$runtime/" -e "s/^ramp_time=.*/ramp_time=$ramp/" \
        "bench/jobs/$f.fio" >"$SCRATCH/jobs/$f.fio"
done

# run BACKEND FILE REP SERVER_PID...: one job file, its JSON and the servers' CPU over it.
run() {
    local backend=$1 f=$2 rep=$3 c0 json
    shift 3
    mkdir -p "$out/json/$backend"
    json=$out/json/$backend/$f.rep$rep.json
    c0=$(cpu "$@")
    case $backend in
        rpma-dax | rpma-disk)
            local nsid=1
            [ "$backend" = rpma-disk ] && nsid=2
            ini --nsid "$nsid" bench --job "$SCRATCH/jobs/$f.fio" --output-format json >"$json" ||
                { echo "bench: rpma-initiator bench --job failed on $backend, $f.fio" >&2; rm -f "$json"; }
            ;;
        *)
            local uri
            case $backend in
                rpma-nbd-dax) uri="nbd+unix:///dax?socket=$SCRATCH/rpma-nbd.sock" ;;
                nbdkit-shm) uri="nbd+unix:///?socket=$SCRATCH/nbdkit-shm.sock" ;;
                nbdkit-disk) uri="nbd+unix:///?socket=$SCRATCH/nbdkit-disk.sock" ;;
            esac
            printf '[global]\nioengine=nbd\nuri=%s\n' "$uri" |
                cat - "$SCRATCH/jobs/$f.fio" >"$SCRATCH/jobs/$backend-$f.fio"
            # A failed section is kept in the JSON (its "error") and shown as missing.
            fio --output-format=json --output="$json" "$SCRATCH/jobs/$backend-$f.fio" >/dev/null ||
                echo "bench: fio on $backend, $f.fio: some section failed (see $json)" >&2
            ;;
    esac
    echo "$backend $f $rep $(secs $(($(cpu "$@") - c0)))" >>"$out/cpu.tsv"
}

for rep in $(seq "$reps"); do
    for f in "${files[@]}"; do
        echo "repetition $rep/$reps: $f.fio (load $(cut -d' ' -f1 /proc/loadavg))"
        run rpma-dax "$f" "$rep" "$target_pid"
        run nbdkit-shm "$f" "$rep" "$nbdkit_shm"
        run rpma-disk "$f" "$rep" "$target_pid"
        run nbdkit-disk "$f" "$rep" "$nbdkit_disk"
        run rpma-nbd-dax "$f" "$rep" "$target_pid" "$rpma_nbd"
    done
done

echo "the floor: raw TCP ping-pong and stream, and the tcp transport alone (fabric_bench)"
iters=20000
[ "$quick" = 1 ] && iters=5000
# The transport's own figure with the target's defaults (CRC on, ULPDU cut to the MSS) on a
# dax (forced) region: a 4 KiB Write + an 8-byte APM Read at QD1, no storage protocol above.
"$BIN/examples/fabric_bench" --reps "$reps" --iters "$iters" --gib 1 \
    --only "crc on, ulpdu default (MSS), dax (forced)" 2>/dev/null |
    grep -E '^\|( case|---| raw TCP| crc on)' >"$out/floor.txt" || true

echo "Load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); the run took $(($(date +%s) - begin)) s" \
    >>"$out/machine.txt"
echo
python3 bench/report.py "$out"
