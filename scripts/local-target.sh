# Sourced by scripts/demo.sh and bench/run.sh (from the repo root): a throw-away rpma-target on
# 127.0.0.1.
#
#   local_setup NAME               -> builds the release binaries and sets BIN (their dir; with
#                                     RPMA_BENCH_BIN set, as bench/run.sh --bin does, that dir,
#                                     unbuilt),
#                                     SCRATCH (scratch/NAME.XXXXXX under the repo: a disk, so
#                                     its files are page-cache), shm (/dev/shm/rpma-NAME-PID.pmem)
#                                     and URL (free_port); the EXIT trap stops the target and
#                                     removes both, also on failure or ^C
#   write_config NQN HOSTNQN SHM_SIZE NS2_SIZE
#                                  -> $SCRATCH/target.toml: URL, control socket control.sock,
#                                     subsystem NQN for HOSTNQN; nsid 1 on $shm (force_dax),
#                                     nsid 2 on $SCRATCH/ns2.pmem
#   bench_config                   -> the benchmarks' target: sets NQN and HOSTNQN (the bench
#                                     pair) and writes their config, 128 MiB on each namespace
#   BIN=<dir of the release binaries>; SCRATCH=<its scratch dir>   (set by local_setup)
#   free_port                      -> sets URL (tcp://127.0.0.1:PORT, nothing listening there)
#   start_target CONFIG SOCKET     -> starts rpma-target on CONFIG, sets target_pid, waits until
#                                     its control SOCKET answers (fails if it exits first)
#   stop_target                    -> SIGTERM, wait; prints nothing; safe to call twice
#   pin_target WHO                 -> the started target alone on the last CPU (taskset, every
#                                     thread); sets last (that CPU) and client (a taskset
#                                     prefix putting a client on the others); exits 2 naming
#                                     WHO on a machine with one CPU
#
# The caller's EXIT trap should call stop_target (local_setup's does), so that a failure or ^C
# never leaves a target behind.

target_pid=

local_setup() {
    local name=$1
    if [ -n "${RPMA_BENCH_BIN:-}" ]; then
        BIN=$RPMA_BENCH_BIN
    else
        cargo build --quiet --release -p rpma-target -p rpma-initiator
        BIN=$PWD/build/release
    fi
    mkdir -p scratch
    SCRATCH=$(mktemp -d "$PWD/scratch/$name.XXXXXX")
    shm=/dev/shm/rpma-$name-$$.pmem
    trap local_cleanup EXIT
    trap 'exit 130' INT TERM
    free_port
}

local_cleanup() {
    stop_target || true
    rm -f "$shm"
    rm -rf "$SCRATCH"
}

write_config() {
    local nqn=$1 hostnqn=$2 shm_size=$3 ns2_size=$4
    cat >"$SCRATCH/target.toml" <<TOML
listen = ["$URL"]
control_socket = "control.sock"
[[subsystem]]
nqn = "$nqn"
hosts = [{ nqn = "$hostnqn" }]
[[subsystem.namespace]]
nsid = 1
path = "$shm"
size = "$shm_size"
force_dax = true
[[subsystem.namespace]]
nsid = 2
path = "$SCRATCH/ns2.pmem"
size = "$ns2_size"
TOML
}

bench_config() {
    NQN=nqn.2026-11.io.rpma:bench
    HOSTNQN=nqn.2026-11.io.rpma:bench-host
    write_config "$NQN" "$HOSTNQN" 128MiB 128MiB
}

free_port() {
    local p
    URL=
    for p in $(seq 7420 7520); do
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            URL=tcp://127.0.0.1:$p
            return 0
        fi
    done
    echo "no free port in 7420-7520 on 127.0.0.1" >&2
    return 1
}

start_target() {
    local config=$1 socket=$2
    RUST_LOG=${RUST_LOG:-warn} "$BIN/rpma-target" --config "$config" &
    target_pid=$!
    for _ in $(seq 300); do
        "$BIN/rpma-target" status --socket "$socket" >/dev/null 2>&1 && return 0
        if ! kill -0 "$target_pid" 2>/dev/null; then
            target_pid=
            echo "rpma-target exited before it was ready" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "rpma-target was not ready within 30 s" >&2
    return 1
}

pin_target() {
    last=$(($(nproc) - 1))
    [ "$last" -ge 1 ] || { echo "$1: --pin needs 2 CPUs or more" >&2; exit 2; }
    taskset -a -p -c "$last" "$target_pid" >/dev/null
    client=(taskset -c "0-$((last - 1))")
}

stop_target() {
    local rc=0
    if [ -n "$target_pid" ]; then
        kill -TERM "$target_pid" 2>/dev/null || true
        wait "$target_pid" 2>/dev/null || rc=$?
        target_pid=
    fi
    return "$rc"
}
