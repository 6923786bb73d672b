#!/usr/bin/env bash
# A Docker engine for the sandbox tests, on loopback only: `eval "$(bash .ci/docker.sh start)"`, then
# `bash .ci/docker.sh stop` (by its PID file). No bridge, no iptables: sandboxes run with --network none,
# and these machines flag traffic to private ranges (docs/sandboxes.md). Everything lives under one
# directory (GYM_DOCKER_DIR), so it never meets a system engine's socket or data.
set -euo pipefail
dir=${GYM_DOCKER_DIR:-/var/tmp/gym-runtime-docker}
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"

case "${1:-}" in
start)
    # docker-compose (Debian's 1.29, v1): the deploy test runs deploy/compose.host.yaml with it
    if ! command -v /usr/sbin/dockerd >/dev/null || ! command -v debootstrap >/dev/null \
        || ! command -v /usr/bin/docker-compose >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >&2
        apt-get install -y -qq docker.io debootstrap docker-compose >/dev/null
    fi
    # a leftover default bridge (172.17.0.0/16) from an engine started without --bridge=none
    if ip link show docker0 >/dev/null 2>&1; then
        ip link delete docker0 >&2 || true
    fi
    mkdir -p "$dir/root" "$dir/exec"
    fresh=0
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        : # already running (a second start in one session)
    else
        fresh=1
        rm -f "$pidfile" "$sock"
        setsid /usr/sbin/dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
            --data-root "$dir/root" --exec-root "$dir/exec" --pidfile "$pidfile" \
            -H "unix://$sock" >"$dir/dockerd.log" 2>&1 </dev/null &
    fi
    for _ in $(seq 1 300); do
        if curl -fsS --unix-socket "$sock" http://engine/_ping >/dev/null 2>&1; then
            if [ "$fresh" = 1 ]; then
                # This engine is the tests' own: a container in it now is left from a run that was killed
                # before its clean-up. A Compose recipe's servers (restart: unless-stopped) come back with
                # every engine start, and would hold CPU and ports for the whole next run.
                left=$(DOCKER_HOST="unix://$sock" docker ps -aq)
                if [ -n "$left" ]; then
                    echo "removing $(echo "$left" | wc -l) containers left by an earlier run" >&2
                    # shellcheck disable=SC2086
                    DOCKER_HOST="unix://$sock" docker rm -f $left >/dev/null
                fi
            fi
            echo "export DOCKER_HOST=unix://$sock GYM_DOCKER_DIR=$dir"
            exit 0
        fi
        sleep 0.1
    done
    echo "dockerd did not answer on $sock within 30 s; its log: $dir/dockerd.log" >&2
    tail -5 "$dir/dockerd.log" >&2 || true
    exit 1
    ;;
stop)
    if [ -f "$pidfile" ]; then
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 150); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    fi
    ;;
*)
    echo "usage: bash .ci/docker.sh start|stop" >&2
    exit 2
    ;;
esac
