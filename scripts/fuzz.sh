#!/usr/bin/env bash
# Runs each cargo-fuzz target (fuzz/) for N seconds, growing its corpus in fuzz/corpus/<target>/,
# then reports the figures. `make reliability` calls `scripts/fuzz.sh --seconds 600`; `make test`
# never fuzzes (tests/tests/fuzz_corpus.rs replays the committed corpus).
#
#   scripts/fuzz.sh [--seconds N] [--target NAME]... [--minimize] [--report FILE] [--jobs N]
#
# --seconds N   fuzzing time per target (default 60)
# --target NAME only this target (repeatable; default: all of them)
# --minimize    afterwards, shrink each corpus to a small set of inputs that keeps its edge
#               coverage (cargo fuzz cmin, set cover): what gets committed
# --report FILE also write the figures there (TSV: target, seconds, runs, corpus files, crashes)
# --jobs N      run N targets at once (default 1; this is CPU-bound)
#
# A crash leaves its input in fuzz/artifacts/<target>/ and makes the script exit 1 after all
# targets ran: fix it, add the input to the corpus (the replay test then guards the fix).
#
# Toolchain: cargo fuzz needs nightly-only rustc flags (-Zsanitizer=address, sancov). On a
# stable toolchain the script sets RUSTC_BOOTSTRAP=1, which lets stable rustc accept them
# (tested with rustc 1.95); cargo-fuzz is installed with `cargo install` if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=60
targets=()
minimize=0
report=""
jobs=1
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --target) targets+=("$2"); shift 2 ;;
    --minimize) minimize=1; shift ;;
    --report) report="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$seconds" in ''|*[!0-9]*) echo "fuzz.sh: --seconds needs a number" >&2; exit 2 ;; esac

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
if ! rustc -vV | grep -q '^release: .*nightly'; then
  export RUSTC_BOOTSTRAP=1
fi
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi

# Seeds built with the crates' own encoders: only the missing ones are written.
cargo run -q -p rpma-tests --example fuzz_seeds

logs=build/fuzz
mkdir -p "$logs"
touch "$logs/started"
echo "fuzz.sh: building the targets"
cargo fuzz build --fuzz-dir fuzz -O

run_one() {
  local t="$1" log="$logs/$1.log"
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  # -timeout: one input may take 10 s at most; -rss_limit_mb: the receivers' rings are small.
  if cargo fuzz run --fuzz-dir fuzz -O "$t" "fuzz/corpus/$t" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      >"$log" 2>&1; then
    echo "fuzz.sh: $t: done"
  else
    echo "fuzz.sh: $t: FAILED (see $log and fuzz/artifacts/$t/)"
  fi
}

running=0
for t in "${targets[@]}"; do
  run_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

if [ "$minimize" -eq 1 ]; then
  for t in "${targets[@]}"; do
    # The smallest set (greedy set cover) that reaches every edge the corpus reaches; hit
    # counts are left out, or an input per count bucket would be kept.
    cargo fuzz cmin --fuzz-dir fuzz -O "$t" "fuzz/corpus/$t" -- -set_cover_merge=1 \
      -use_counters=0 >"$logs/$t.cmin.log" 2>&1 \
      || echo "fuzz.sh: $t: cmin failed (see $logs/$t.cmin.log)"
  done
  # cmin keeps inputs by coverage under new names: the named seeds come back (the replay test
  # wants them), and so do the regression inputs, which git still has.
  cargo run -q -p rpma-tests --example fuzz_seeds
  git checkout -- 'fuzz/corpus/*/regress-*' 2>/dev/null || true
fi

status=0
table=$(printf 'target\tseconds\truns\tcorpus_files\tcrashes\n')
for t in "${targets[@]}"; do
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -n 1)
  files=$(find "fuzz/corpus/$t" -type f | wc -l)
  crashes=$(find "fuzz/artifacts/$t" -type f -newer "$logs/started" \
    \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' \) | wc -l)
  [ "$crashes" -eq 0 ] || status=1
  grep -q 'Done [0-9]* runs in' "$logs/$t.log" || status=1
  table+=$(printf '\n%s\t%s\t%s\t%s\t%s' "$t" "$seconds" "${runs:-?}" "$files" "$crashes")
done
if command -v column >/dev/null 2>&1; then
  echo "$table" | column -t -s $'\t'
else
  echo "$table"
fi
if [ -n "$report" ]; then
  mkdir -p "$(dirname "$report")"
  echo "$table" >"$report"
fi
exit "$status"
