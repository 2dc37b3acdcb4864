#!/usr/bin/env bash
# The page cache's folio sizes and rpma-disk's 1 MiB writes (docs/benchmarks.md, "The page-cache
# 1 MiB writes outside the matrix"). A fresh rpma-target (scripts/local-target.sh),
# then on its page-cache namespace (nsid 2) either
#   large: 1 MiB sequential writes onto pages not yet cached (the kernel caches them in large
#          folios, as bench/run.sh's matrix does when bw.fio is the first to write), or
#   small: 3 s of 4 KiB random writes first (4 KiB folios, as the matrix's lat.fio and
#          iops.fio leave them), then the same 1 MiB writes.
# Each run: MiB/s and the target's ext4_da_write_begin calls per MiB (one per folio a pwrite
# touches), counted by `perf stat` on the tracepoint.
#
#   bench/pagecache-folios.sh [--runs N] [--bin DIR] large|small
#     --runs N   1 MiB write runs of 5 s at QD4 (default 4)
#     --bin DIR  the rpma-target and rpma-initiator to run (default: this tree's release build)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=4
while [ $# -gt 0 ]; do
    case $1 in
        --runs) runs=$2; shift 2 ;;
        --bin) RPMA_BENCH_BIN=$(cd "$2" && pwd); export RPMA_BENCH_BIN; shift 2 ;;
        -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        large | small) break ;;
        *) echo "bench/pagecache-folios.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ $# -eq 1 ] || { echo "bench/pagecache-folios.sh: name one variant, large or small" >&2; exit 2; }
variant=$1
command -v perf >/dev/null || { echo "bench/pagecache-folios.sh: perf is missing (Debian: apt-get install linux-perf)" >&2; exit 1; }
# shellcheck source=scripts/local-target.sh
. scripts/local-target.sh
local_setup folios
bench_config
start_target "$SCRATCH/target.toml" "$SCRATCH/control.sock"
ini() { "$BIN/rpma-initiator" --target "$URL" --nqn "$NQN" --hostnqn "$HOSTNQN" --nsid 2 "$@"; }
job() { printf '[global]\nsize=64m\noffset=0\ntime_based=1\nruntime=%s\n[j]\n' "$1"; tr ' ' '\n' <<<"$2"; }
job 5 'rw=write bs=1m iodepth=4' >"$SCRATCH/bw.fio"
job 3 'rw=randwrite bs=4k iodepth=16' >"$SCRATCH/small.fio"
resident() { fincore -nb "$SCRATCH/ns2.pmem" | awk '{print $1 + 0}'; }
echo "# $(date -u +%FT%TZ), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), kernel $(uname -r)"
echo "# variant $variant; the namespace's file has $(resident) bytes in the page cache"
if [ "$variant" = small ]; then
    ini bench --job "$SCRATCH/small.fio" --output-format json >/dev/null
    echo "# after 3 s of 4 KiB random writes: $(resident) bytes cached"
fi
for i in $(seq "$runs"); do
    perf stat -x, -e ext4:ext4_da_write_begin -p "$target_pid" -o "$SCRATCH/stat" -- sleep 4.5 &
    perf_pid=$!
    ini bench --job "$SCRATCH/bw.fio" --output-format json >"$SCRATCH/out.json"
    wait "$perf_pid"
    python3 - "$i" "$SCRATCH/out.json" "$SCRATCH/stat" <<'EOF'
import json, sys
mib = json.load(open(sys.argv[2]))["jobs"][0]["write"]["bw"] / 1024
calls = next(int(l.split(",")[0]) for l in open(sys.argv[3]) if "ext4_da_write_begin" in l)
print(f"run {sys.argv[1]}: {mib:.0f} MiB/s, {calls / (mib * 4.5):.0f} ext4_da_write_begin per MiB")
EOF
done
