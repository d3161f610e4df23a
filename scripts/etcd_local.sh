#!/usr/bin/env bash
# Starts a single-member etcd on loopback for manual use with wbridge (etcd://HOST:PORT).
# Foreground: Ctrl-C stops it and removes its temporary data directory.
#   scripts/etcd_local.sh [PORT] [HOST]        defaults: 2379 127.0.0.1
# Needs Debian's etcd-server (apt-get install -y etcd-server; binary /usr/bin/etcd).
set -euo pipefail

PORT="${1:-2379}"
HOST="${2:-127.0.0.1}"
PEER_PORT="$((PORT + 1))"
ETCD="$(command -v etcd || true)"
if [[ -z "$ETCD" ]]; then
    echo "etcd not found; install it with: apt-get install -y etcd-server" >&2
    exit 1
fi
case "$HOST" in
    0.0.0.0|::|"") echo "refusing to listen on all interfaces; give a concrete address" >&2; exit 1 ;;
esac

DATA="$(mktemp -d /tmp/wbridge-etcd.XXXXXX)"
cleanup() { rm -rf "$DATA"; }
trap cleanup EXIT

echo "etcd on etcd://$HOST:$PORT (data in $DATA); Ctrl-C to stop" >&2
# Not exec: the EXIT trap must run after etcd stops to remove the data directory.
"$ETCD" --name wbridge-local --data-dir "$DATA" \
    --listen-client-urls "http://$HOST:$PORT" --advertise-client-urls "http://$HOST:$PORT" \
    --listen-peer-urls "http://$HOST:$PEER_PORT" --initial-advertise-peer-urls "http://$HOST:$PEER_PORT" \
    --initial-cluster "wbridge-local=http://$HOST:$PEER_PORT" \
    --logger zap --log-level warn &
PID=$!
trap 'kill -TERM "$PID" 2>/dev/null || true' INT TERM
wait "$PID" || true
wait "$PID" 2>/dev/null || true
