# Sourced by scripts/demo.sh and bench/run.sh: a throw-away rpma-target on 127.0.0.1.
#
#   BIN=<dir of the release binaries>; SCRATCH=<its scratch dir>
#   free_port                      -> sets URL (tcp://127.0.0.1:PORT, nothing listening there)
#   start_target CONFIG SOCKET     -> starts rpma-target on CONFIG, sets target_pid, waits until
#                                     its control SOCKET answers (fails if it exits first)
#   stop_target                    -> SIGTERM, wait; prints nothing; safe to call twice
#
# The caller's EXIT trap should call stop_target, so that a failure or ^C never leaves a target
# behind.

target_pid=

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

stop_target() {
    local rc=0
    if [ -n "$target_pid" ]; then
        kill -TERM "$target_pid" 2>/dev/null || true
        wait "$target_pid" 2>/dev/null || rc=$?
        target_pid=
    fi
    return "$rc"
}
