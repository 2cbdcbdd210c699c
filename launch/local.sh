#!/usr/bin/env bash
# rlhf_megatron on one machine, the same flow as launch/slurm/rlhf_megatron.sbatch: start a Ray
# head here, run the trainer against it (ray.address=...), stop Ray on exit.
#
#   launch/local.sh configs/quickstart_cpu.yaml trainer.total_steps=20
#   NUM_GPUS=8 launch/local.sh configs/qwen2.5-32b_grpo_2x8.yaml  # + resources.devices_per_node=8
#   TRAIN_CMD='python my_driver.py' launch/local.sh    # any command; RAY_ADDRESS is exported
#
# Variables (launch/README.md): RAY, PYTHON, RAY_PORT, RAY_DASHBOARD_PORT, RAY_CLIENT_SERVER_PORT,
# NUM_GPUS, NUM_CPUS, RAY_TEMP_DIR, RAY_START_ARGS, RAY_WAIT_TIMEOUT_S, LOG_DIR, TRAIN_CMD,
# STOP_GRACE_S, RAY_AUTH_MODE/RAY_AUTH_TOKEN(_PATH). The exit status is the trainer's.

set -euo pipefail

RAY=${RAY:-ray}
PYTHON=${PYTHON:-python}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
RAY_CLIENT_SERVER_PORT=${RAY_CLIENT_SERVER_PORT:-10001}
RAY_WAIT_TIMEOUT_S=${RAY_WAIT_TIMEOUT_S:-120}
STOP_GRACE_S=${STOP_GRACE_S:-30}
LOG_DIR=${LOG_DIR:-logs/local-$(date +%Y%m%d-%H%M%S)}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
# `ray start --block` drains its node on SIGTERM (for Ray Serve) for up to this many seconds
# before stopping; at teardown nothing is left to drain, so stop at once.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
HEAD_IP=127.0.0.1

RAY_PID=""
TRAINER_PID=""

log() { printf '[launch %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The pids below $1 (its children, theirs, ...).
descendants() {
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

# SIGTERM the trainer's process group and `ray start --block` (which stops its Ray processes),
# SIGKILL what is left after STOP_GRACE_S, Ray's own processes included (read before the stop: a
# `ray start` killed mid-stop under load once left its gcs_server and raylet behind, orphaned);
# the script exits with the status it had.
teardown() {
    local rc=$? pid deadline ray_tree=""
    trap - EXIT INT TERM
    if [[ -n "$TRAINER_PID" ]] && kill -0 "$TRAINER_PID" 2>/dev/null; then
        # The trainer alone first: on SIGTERM it saves a checkpoint after its step, with Ray up.
        log "stopping the trainer (it saves a checkpoint after its step; up to ${STOP_GRACE_S}s)"
        kill -TERM "$TRAINER_PID" 2>/dev/null || true
        deadline=$((SECONDS + STOP_GRACE_S))
        while kill -0 "$TRAINER_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -TERM -- "-$TRAINER_PID" 2>/dev/null || true  # what is left of its group
    fi
    if [[ -n "$RAY_PID" ]]; then
        ray_tree=$(descendants "$RAY_PID")
        log "stopping Ray"
        kill -TERM "$RAY_PID" 2>/dev/null || true
    fi
    deadline=$((SECONDS + STOP_GRACE_S))
    for pid in $TRAINER_PID $RAY_PID $ray_tree; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    exit "$rc"
}

# As in the sbatch script: pin the Ray auth mode for every process (a head that finds
# ~/.ray/auth_token turns token auth on, the trainer joining it would not); token mode with a
# fresh token per run unless RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH say otherwise.
setup_ray_auth() {
    export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
    [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]] \
        || return 0
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
    (umask 077 && printf '%s\n' "$RAY_AUTH_TOKEN" > "$LOG_DIR/ray_auth_token")
}

start_ray_head() {
    local -a cmd=("$RAY" start --head --block --disable-usage-stats "--port=$RAY_PORT"
                  "--node-ip-address=$HEAD_IP" "--dashboard-port=$RAY_DASHBOARD_PORT"
                  "--ray-client-server-port=$RAY_CLIENT_SERVER_PORT")
    [[ -z "${NUM_GPUS:-}" ]] || cmd+=("--num-gpus=$NUM_GPUS")
    [[ -z "${NUM_CPUS:-}" ]] || cmd+=("--num-cpus=$NUM_CPUS")
    [[ -z "${RAY_TEMP_DIR:-}" ]] || cmd+=("--temp-dir=$RAY_TEMP_DIR")
    local -a extra=()
    read -r -a extra <<< "${RAY_START_ARGS:-}"
    cmd+=("${extra[@]}")
    log "ray start (log: $LOG_DIR/ray-head.log)"
    "${cmd[@]}" > "$LOG_DIR/ray-head.log" 2>&1 < /dev/null &
    RAY_PID=$!
}

wait_for_head() {
    local deadline=$((SECONDS + RAY_WAIT_TIMEOUT_S))
    until (exec 3<> "/dev/tcp/$HEAD_IP/$RAY_PORT") 2>/dev/null; do
        if ! kill -0 "$RAY_PID" 2>/dev/null; then
            tail -n 15 "$LOG_DIR/ray-head.log" >&2 || true
            die "ray start exited; its log: $LOG_DIR/ray-head.log"
        fi
        ((SECONDS < deadline)) || die "Ray did not come up within ${RAY_WAIT_TIMEOUT_S}s"
        sleep 1
    done
}

main() {
    local -a cmd
    if [[ -n "${TRAIN_CMD:-}" ]]; then
        cmd=(bash -c "$TRAIN_CMD" train-cmd "$@")
    else
        (($# > 0)) || die "usage: launch/local.sh CONFIG.yaml [key=value ...] (or set TRAIN_CMD)"
        cmd=("$PYTHON" -m rlhf_megatron train --config "$1" "ray.address=$HEAD_IP:$RAY_PORT"
             resources.nodes=1)
        [[ -z "${NUM_GPUS:-}" ]] || cmd+=("resources.devices_per_node=$NUM_GPUS")
        cmd+=("${@:2}")
    fi
    mkdir -p "$LOG_DIR"
    setup_ray_auth
    trap teardown EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
    start_ray_head
    wait_for_head

    export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"
    log "trainer: ${cmd[*]}"
    local -a prefix=()
    if command -v setsid > /dev/null; then prefix=(setsid); fi  # own group: teardown stops it all
    "${prefix[@]}" "${cmd[@]}" < /dev/null &
    TRAINER_PID=$!
    local rc=0
    # Poll rather than `wait`, so that a Ray head that dies mid-run ends the job too.
    while kill -0 "$TRAINER_PID" 2>/dev/null; do
        kill -0 "$RAY_PID" 2>/dev/null || die "Ray died during training; see $LOG_DIR/ray-head.log"
        sleep 2
    done
    wait "$TRAINER_PID" || rc=$?
    TRAINER_PID=""
    log "trainer exited with status $rc"
    return "$rc"
}

main "$@"
