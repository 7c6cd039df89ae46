#!/usr/bin/env bash
# Make a Docker engine available for the Docker tests (CI and developers).
#
# Usage: scripts/ci-docker.sh run CMD [ARG...]   start, run CMD, stop (what .ci/run uses)
#        scripts/ci-docker.sh start              install if needed, start dockerd if none runs
#        scripts/ci-docker.sh stop               stop the dockerd that `start` started
#        scripts/ci-docker.sh status             say whether an engine answers
#
# Installs Debian's docker.io, docker-compose (the v1 `docker-compose` command),
# debootstrap (for the local base image) and openssl when they are missing
# (apt-get update first; needs root or sudo). When no engine answers on
# /var/run/docker.sock, starts /usr/sbin/dockerd in the background with its log in
# $TESSERA_DOCKERD_DIR (default /tmp/tessera-dockerd), and `stop` (or the end of
# `run`) stops exactly that dockerd again; an engine that was already running is
# left alone. `run` exports TESSERA_REQUIRE_DOCKER=1 so that the Docker tests fail
# instead of skipping when the engine is unusable. Exits non-zero when no engine
# can be had.
set -euo pipefail

LOG_PREFIX=ci-docker
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

STATE_DIR="${TESSERA_DOCKERD_DIR:-/tmp/tessera-dockerd}"
PID_FILE="$STATE_DIR/dockerd.pid"
DOCKERD_LOG="$STATE_DIR/dockerd.log"
SOCKET=/var/run/docker.sock
STARTED=0 # set by start() when it launched dockerd

usage() { # the comment block at the top of this file
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
}

as_root() { # as_root CMD...: run CMD as root (directly, or through sudo -n)
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif have sudo; then
        sudo -n "$@"
    else
        die "'$*' needs root; run as root or install sudo"
    fi
}

engine_up() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

install_tools() {
    local missing=()
    [ -x /usr/sbin/dockerd ] || missing+=(docker.io)
    have docker-compose || missing+=(docker-compose)
    have debootstrap || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
    have openssl || missing+=(openssl)
    if [ "${#missing[@]}" -eq 0 ]; then
        return 0
    fi
    have apt-get || die "missing ${missing[*]} and no apt-get to install them; install them by hand"
    log "installing ${missing[*]} from Debian (apt-get update first)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${missing[@]}" >/dev/null
    # --no-install-recommends leaves out what dockerd needs at run time on a bare machine.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        iptables containerd runc tini ca-certificates >/dev/null
}

start() {
    install_tools
    if engine_up; then
        log "a Docker engine already answers ($(docker version --format 'server {{.Server.Version}}')); using it"
        return 0
    fi
    if [ -S "$SOCKET" ] && [ -f "$PID_FILE" ] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
        log "dockerd $(cat "$PID_FILE") is starting; waiting for it"
    else
        mkdir -p "$STATE_DIR"
        STARTED=1
        log "starting dockerd (log: $DOCKERD_LOG)"
        # setsid: its own session, so that CI's process group signals do not reach it
        # before `stop` does. Its own pid file names the daemon (not sudo or setsid).
        rm -f "$STATE_DIR/docker.pid"
        if [ "$(id -u)" = 0 ]; then
            setsid /usr/sbin/dockerd --host "unix://$SOCKET" --pidfile "$STATE_DIR/docker.pid" \
                </dev/null >"$DOCKERD_LOG" 2>&1 &
        else
            # shellcheck disable=SC2024 # the log is ours to write
            sudo -n setsid /usr/sbin/dockerd --host "unix://$SOCKET" \
                --pidfile "$STATE_DIR/docker.pid" </dev/null >"$DOCKERD_LOG" 2>&1 &
        fi
        echo $! >"$PID_FILE"
    fi
    local i
    for i in $(seq 1 60); do
        if engine_up; then
            [ ! -s "$STATE_DIR/docker.pid" ] || cp "$STATE_DIR/docker.pid" "$PID_FILE"
            log "dockerd $(cat "$PID_FILE") is up after ${i}s ($(docker version --format 'server {{.Server.Version}}'))"
            return 0
        fi
        if ! kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
            tail_log "$DOCKERD_LOG" 30
            rm -f "$PID_FILE"
            die "dockerd exited at start; see $DOCKERD_LOG"
        fi
        sleep 1
    done
    tail_log "$DOCKERD_LOG" 30
    die "dockerd did not answer within 60s; see $DOCKERD_LOG"
}

stop() {
    [ -f "$PID_FILE" ] || return 0
    local pid
    pid="$(cat "$PID_FILE")"
    rm -f "$PID_FILE"
    kill -0 "$pid" 2>/dev/null || return 0
    log "stopping dockerd $pid (started by this script)"
    as_root kill -TERM "$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 30); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 1
    done
    warn "dockerd $pid still runs after 30s; sending SIGKILL"
    as_root kill -KILL "$pid" 2>/dev/null || true
}

case "${1:-}" in
    run)
        shift
        [ $# -gt 0 ] || die "run needs a command, e.g. run bash scripts/test.sh"
        start
        # Stop only what this invocation started, never an engine that ran before.
        if [ "$STARTED" = 1 ]; then
            trap stop EXIT
        fi
        export TESSERA_REQUIRE_DOCKER=1
        rc=0
        "$@" || rc=$?
        exit "$rc"
        ;;
    start) start ;;
    stop) stop ;;
    status)
        if engine_up; then
            docker version --format 'engine {{.Server.Version}} (API {{.Server.APIVersion}})'
        else
            echo "no Docker engine answers on $SOCKET"
            exit 1
        fi
        ;;
    -h | --help | '') usage ;;
    *) die "unknown command '$1'; see --help" ;;
esac
