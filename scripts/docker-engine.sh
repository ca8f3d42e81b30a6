#!/usr/bin/env bash
# A Docker engine for `make test-compose` (scripts/test-compose.sh) and .ci/run.
#
#   scripts/docker-engine.sh ensure   make `docker` work: install Docker and Compose from
#                                     Debian's packages where they are missing (as root, with
#                                     apt-get), and start dockerd if none answers
#   scripts/docker-engine.sh stop     stop the dockerd that `ensure` started, if it did
#   scripts/docker-engine.sh probe    can this machine run Docker? ensure, then stop again
#
# An engine that already answers (`docker info`) is used as it is and never stopped. One that
# this script starts runs as `dockerd $DOCKERD_ARGS`, by default with the vfs storage driver
# (works where overlay mounts do not, such as inside a container or a VM without the module)
# and without iptables rules (nothing here needs NAT: make test-compose uses the host's
# network), logs to target/docker-engine/dockerd.log and is stopped by its pid.
#
# One engine serves every clone on the machine, so `probe` and scripts/test-compose.sh take one
# machine-wide lock, $TMPDIR/pd-filter-docker-engine.lock on file descriptor 9, for as long as
# they use it: a run never finds an engine that another run is about to stop.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=target/docker-engine
pidfile=$dir/dockerd.pid
DOCKERD_ARGS=${DOCKERD_ARGS:---storage-driver=vfs --iptables=false}

say() { echo "docker-engine: $*"; }

# lock_engine WHO: hold the machine-wide lock on fd 9 until this process and the ones it starts
# (but dockerd) have ended; waits for another holder at most 30 minutes.
lock_engine() {
    local lock=${TMPDIR:-/tmp}/pd-filter-docker-engine.lock
    exec 9>>"$lock"
    if ! flock -n 9; then
        echo "$1: another run is using the Docker engine ($lock held); waiting for it"
        flock -w 1800 9 || { echo "$1: still held after 30 minutes" >&2; return 1; }
    fi
}

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

compose_present() {
    docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1
}

install_missing() {
    local packages=()
    command -v docker >/dev/null 2>&1 || packages+=(docker.io)
    if ! engine_answers && ! command -v dockerd >/dev/null 2>&1; then
        packages+=(docker.io)
    fi
    compose_present || packages+=(docker-compose)
    [ ${#packages[@]} -eq 0 ] && return 0
    # shellcheck disable=SC2207 # unique names, no spaces
    packages=($(printf '%s\n' "${packages[@]}" | sort -u))
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "missing ${packages[*]}, and no root with apt-get here to install them"
        return 1
    fi
    say "installing ${packages[*]} from Debian's packages"
    apt-get update -q >/dev/null || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${packages[@]}" >/dev/null || return 1
}

ensure() {
    install_missing || return 1
    if engine_answers; then
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        say "no Docker engine answers, and only root can start one here"
        return 1
    fi
    mkdir -p "$dir"
    say "starting dockerd $DOCKERD_ARGS (log: $dir/dockerd.log)"
    # Its own session, no terminal, output to a file: nothing waits on it but this pid file.
    # shellcheck disable=SC2086 # DOCKERD_ARGS is a list of arguments
    # fd 9 (the lock) closed: a dockerd left running must not keep the lock.
    setsid dockerd $DOCKERD_ARGS </dev/null >"$dir/dockerd.log" 2>&1 9>&- &
    echo $! >"$pidfile"
    local _
    for _ in $(seq 60); do
        if engine_answers; then
            say "dockerd is up (pid $(cat "$pidfile"))"
            return 0
        fi
        if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            say "dockerd exited; the end of its log:"
            tail -n 15 "$dir/dockerd.log" | sed 's/^/  /'
            rm -f "$pidfile"
            return 1
        fi
        sleep 1
    done
    say "dockerd did not answer within 60 s; stopping it"
    stop
    return 1
}

stop() {
    [ -f "$pidfile" ] || return 0
    local pid
    pid=$(cat "$pidfile")
    rm -f "$pidfile"
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid"
    local _
    for _ in $(seq 30); do
        kill -0 "$pid" 2>/dev/null || { say "stopped dockerd (pid $pid)"; return 0; }
        sleep 1
    done
    say "dockerd (pid $pid) still running after 30 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

case "${1:-}" in
    ensure) ensure ;;
    stop) stop ;;
    probe)
        lock_engine docker-engine
        if ensure; then
            stop
            say "this machine can run Docker"
        else
            say "this machine cannot run Docker"
            exit 1
        fi
        ;;
    *)
        echo "usage: $0 ensure|stop|probe" >&2
        exit 2
        ;;
esac
