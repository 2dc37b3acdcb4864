#!/usr/bin/env bash
# The rdma floor, in a VM lab guest (docs/testing.md): perftest's ib_write_lat and ib_read_lat
# on Soft-RoCE (rxe0) beside `rpma-initiator bench` over rdma:// on the same device, QD1,
# 4 KiB, each run REPS times in turn; prints every run and the medians, and rpma's ratios to
# the floor. The guest runs under TCG emulation here: the absolute times are slow and mean
# nothing; the ratios are what to compare (docs/benchmarks.md).
#
# Usage (from the repo root, release binaries built: cargo build --release --all-features):
#   scripts/vm-run.sh -- bench/rdma-floor.sh [REPS]
set -euo pipefail

REPS="${1:-5}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="$ROOT/build/release"
DEV="${RPMA_TEST_RDMA_DEVICE:?run in the VM lab: scripts/vm-run.sh -- bench/rdma-floor.sh}"
ADDR="${RPMA_TEST_RDMA_ADDR:?}"
OUT="${RPMA_VM_OUT:-/tmp}/rdma-floor.txt"
for b in rpma-target rpma-initiator; do
  [ -x "$BIN/$b" ] || { echo "rdma-floor: $BIN/$b missing: cargo build --release --all-features" >&2; exit 2; }
done
exec > >(tee "$OUT") 2>&1

WORK="$(mktemp -d /dev/shm/rdma-floor.XXXXXX)"
target_pid=
cleanup() {
  [ -n "$target_pid" ] && kill "$target_pid" 2>/dev/null && wait "$target_pid" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

# t_typical (the median latency, us) of one perftest run: server on the device in the
# background, client to its address.
perftest() {
  local tool=$1 port=$2
  "$tool" -d "$DEV" -s 4096 -n 2000 -F -p "$port" >/dev/null 2>&1 &
  local srv=$!
  sleep 1
  local line
  line=$("$tool" -d "$DEV" -s 4096 -n 2000 -F -p "$port" "$ADDR" 2>/dev/null | awk '$1 == 4096 {print}')
  wait "$srv" || true
  awk '{print $5}' <<<"$line"
}

cat >"$WORK/target.toml" <<EOF
listen = [{ url = "rdma://$ADDR:7499", direct_write_to_pmem = true }]
control_socket = "$WORK/ctl.sock"
[[subsystem]]
nqn = "nqn.2026-12.io.rpma:floor"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
path = "$WORK/ns1"
size = "64MiB"
force_dax = true
EOF
RUST_LOG=warn "$BIN/rpma-target" --config "$WORK/target.toml" &
target_pid=$!
for _ in $(seq 100); do [ -S "$WORK/ctl.sock" ] && break; sleep 0.2; done

# p50 (us) of rpma's QD1 4 KiB durable writes with METHOD, and of its reads.
rpma_bench() {
  local method=$1
  "$BIN/rpma-initiator" --target "rdma://$ADDR:7499" --nqn nqn.2026-12.io.rpma:floor --nsid 1 \
    bench --yes --count 2000 --total 8MiB --persist "$method" --json 2>/dev/null |
    python3 -c '
import json, sys
j = json.load(sys.stdin)
def p50(k):
    for key, v in j.items():
        if isinstance(v, dict) and k in key and "p50_us" in v:
            return "%.1f" % v["p50_us"]
    return "nan"
print(p50("write"), p50("read"))'
}

echo "# rdma floor: $(uname -r), device $DEV, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# TCG emulation: ratios only. 4 KiB, QD1, medians of $REPS runs."
printf '%-4s %12s %12s %14s %14s %14s\n' rep ib_write_lat ib_read_lat rpma_apm_write rpma_gpspm_wr rpma_read
: >"$WORK/rows"
for r in $(seq "$REPS"); do
  w=$(perftest ib_write_lat 18515)
  rd=$(perftest ib_read_lat 18516)
  read -r apm rread < <(rpma_bench apm)
  read -r gpspm _ < <(rpma_bench gpspm)
  printf '%-4s %12s %12s %14s %14s %14s\n' "$r" "$w" "$rd" "$apm" "$gpspm" "$rread"
  echo "$w $rd $apm $gpspm $rread" >>"$WORK/rows"
done
col() { awk -v c="$1" '{print $c}' "$WORK/rows" | median; }
W=$(col 1) RD=$(col 2) APM=$(col 3) GP=$(col 4) RR=$(col 5)
printf '%-4s %12s %12s %14s %14s %14s\n' med "$W" "$RD" "$APM" "$GP" "$RR"
python3 - "$W" "$RD" "$APM" "$GP" "$RR" <<'EOF'
import sys
w, rd, apm, gp, rr = map(float, sys.argv[1:])
print(f"rpma APM durable write / (ib_write_lat + ib_read_lat): {apm / (w + rd):.2f}")
print(f"rpma GPSPM durable write / (ib_write_lat + ib_read_lat): {gp / (w + rd):.2f}")
print(f"rpma read / ib_read_lat: {rr / rd:.2f}")
EOF
