#!/usr/bin/env bash
# bench/run.sh: rpma side by side with its peers, fio-style, medians (bench/README.md).
#
#   bench/run.sh [--quick] [--reps N] [--out DIR] [--bin DIR] [matrix] [pmem] [fabric] [initiator]
#                                                      (no section named: matrix)
#
#   matrix     the fio job files bench/jobs/{lat,iops,bw,mixed}.fio against, in one run:
#              rpma native (rpma-initiator bench --job) on a /dev/shm namespace (force_dax) and
#              on a disk file (page-cache); rpma's NBD export driven by fio's nbd engine; the
#              peer, nbdkit's file plugin on the same kinds of file, driven by fio's nbd engine;
#              the floor (fabric_bench's raw TCP ping-pong and stream); the servers' CPU, idle
#              over 10 s and per operation. Writes DIR (default bench/results): json/BACKEND/
#              FILE.repN.json, cpu.tsv, floor.txt, machine.txt, summary.md and three SVG plots.
#              --quick: 1 s per job section, no ramp, one repetition (under three minutes).
#   pmem       common/examples/pmem_persist: persist cost per flush instruction and msync
#   fabric     common/examples/fabric_bench: the tcp transport against raw TCP, --reps N
#   initiator  `rpma-initiator bench` (the quick one) against a local rpma-target, N runs per
#              namespace: dax (forced) on /dev/shm, a page-cache file (default method, and FLUSH)
#
# --bin DIR: run the rpma-target, rpma-initiator and examples/fabric_bench found in DIR instead of
# building this tree's (an A/B of two builds in one sitting: copy build/release's three aside).
#
# Everything runs on 127.0.0.1 only; scratch files are removed on exit, also on failure or ^C.
set -euo pipefail
cd "$(dirname "$0")/.."

reps=
quick=0
out=bench/results
sections=()
while [ $# -gt 0 ]; do
    case $1 in
        --reps) reps=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        --out) out=$2; shift 2 ;;
        --bin) RPMA_BENCH_BIN=$(cd "$2" && pwd); export RPMA_BENCH_BIN; shift 2 ;;
        matrix | pmem | fabric | initiator) sections+=("$1"); shift ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "bench/run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ ${#sections[@]} -gt 0 ] || sections=(matrix)
[ -n "$reps" ] || { [ "$quick" = 1 ] && reps=1 || reps=3; }
case $reps in
    '' | *[!0-9]* | 0) echo "bench/run.sh: --reps takes a positive number" >&2; exit 2 ;;
esac
wants() { [[ " ${sections[*]} " == *" $1 "* ]]; }

echo "# rpma benchmarks, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load: $(cut -d' ' -f1-3 /proc/loadavg)"

if wants pmem; then
    echo
    echo "## pmem persist cost (cargo run --release -p rpma-common --example pmem_persist)"
    cargo run --quiet --release -p rpma-common --example pmem_persist
fi

if wants fabric; then
    echo
    echo "## fabric: tcp transport against raw TCP (--example fabric_bench -- --reps $reps)"
    cargo run --quiet --release -p rpma-common --example fabric_bench -- --reps "$reps"
fi

if wants matrix; then
    bash bench/matrix.sh "$quick" "$reps" "$out"
fi

if ! wants initiator; then
    exit 0
fi

# shellcheck source=scripts/local-target.sh
. scripts/local-target.sh
local_setup bench
bench_config
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"

# The value of "key": in bench's pretty JSON (the first one: write_latency comes before
# read_latency, so p50_us is the write's unless asked with the read prefix).
field() { sed -n "s/^ *\"$1\": \\([0-9.e+-]*\\),\\{0,1\\}$/\\1/p" | head -1; }
read_p50() { sed -n '/"read_latency"/,/}/s/^ *"p50_us": \([0-9.e+-]*\),\{0,1\}$/\1/p'; }
median() { sort -g | awk '{v[NR] = $1} END {m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f\n", m}'; }

echo
echo "## rpma-initiator bench: QD1 4 KiB x 1000, then 64 MiB at depth 32; median of $reps runs"
echo
printf '| %-34s | %-6s | %13s | %12s | %14s | %13s |\n' namespace method "write p50 us" "read p50 us" "write MiB/s" "read MiB/s"
printf '|%s|%s|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..36})" "--------" "--------------:" "-------------:" "---------------:" "--------------:"
row() {
    local label=$1 nsid=$2 persist=$3 i out method
    local wl=() rl=() wb=() rb=()
    for i in $(seq "$reps"); do
        out=$("$BIN/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" \
            --nsid "$nsid" ${persist:+--persist "$persist"} --json \
            bench --offset 0 --count 1000 --io-size 4k --total 64MiB --depth 32)
        method=$(sed -n 's/^ *"method": "\(.*\)",$/\1/p' <<<"$out")
        wl+=("$(field p50_us <<<"$out")")
        rl+=("$(read_p50 <<<"$out")")
        wb+=("$(field write_mib_s <<<"$out")")
        rb+=("$(field read_mib_s <<<"$out")")
    done
    printf '| %-34s | %-6s | %13s | %12s | %14s | %13s |\n' "$label" "$method" \
        "$(printf '%s\n' "${wl[@]}" | median)" "$(printf '%s\n' "${rl[@]}" | median)" \
        "$(printf '%s\n' "${wb[@]}" | median)" "$(printf '%s\n' "${rb[@]}" | median)"
}
row "dax (forced), /dev/shm" 1 ""
row "page-cache, file under the repo" 2 ""
row "page-cache, --persist flush" 2 flush
echo
echo "(durable writes: write_durable at QD1; bandwidth writes are made durable once at the end)"
