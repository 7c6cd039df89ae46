#!/usr/bin/env bash
# Entry point of Tessera's images: starts one Flower component per container, with
# its flags built from the environment (so compose files and the edge-deploy tool
# set variables, not command lines). Extra arguments go to the component.
#
#   tessera-entrypoint superlink  [flower-superlink args]   SuperLink, process isolation
#   tessera-entrypoint supernode  [flower-supernode args]   SuperNode, process isolation
#   tessera-entrypoint serverapp                            flower-superexec for ServerApps
#   tessera-entrypoint clientapp                            warm ClientApp executor
#   tessera-entrypoint init                                 CA, server certificate, node keys
#   tessera-entrypoint register                             register SuperNode public keys
#   tessera-entrypoint run        [flwr run args]           run the app, wait, check results
#   tessera-entrypoint COMMAND...                           anything else: exec it
#
# Environment (defaults in brackets):
#   TESSERA_TLS [true]               TLS on the Fleet and Control APIs; false: plaintext
#   TESSERA_CERTS [/certs]           ca.crt, server.pem, server.key, keys/node-N{,.pub}
#   TESSERA_SUPERNODE_AUTH [false]   SuperNode authentication (needs TLS)
#   TESSERA_HEALTH_PORT [8081]       loopback port of the component's health server
#   superlink: TESSERA_DATABASE [/data/state.db]
#   supernode: TESSERA_SUPERLINK [superlink:9092], TESSERA_NODE_CONFIG (required),
#              TESSERA_NODE_KEY [$TESSERA_CERTS/keys/node-1] (private key, with auth)
#              TESSERA_SUPERNODE [tessera]: tessera (Flower's flower-supernode with
#              its pulls paced, 0.1 s after a message up to Flower's 3 s while idle,
#              its replies looked for every 0.05 s) or flower (flower-supernode as is)
#   serverapp: TESSERA_APPIO [superlink:9091]; clientapp: TESSERA_APPIO (required,
#              the SuperNode's ClientAppIo address, e.g. supernode-1:9094),
#              TESSERA_EXECUTOR [tessera]: tessera (each message's ClientApp process
#              forked from a fork server that imported torch and Flower once; polls
#              every 0.1 s) or flower (flower-superexec: a fresh flwr-clientapp
#              process per message, polling every second)
#   init:      (as root, hands an empty root-owned TESSERA_OUTPUT_DIR [/results] to
#              TESSERA_UID:TESSERA_GID [1000:1000], then continues as tessera)
#              TESSERA_TLS_NAMES [superlink,localhost,127.0.0.1], TESSERA_NODE_KEYS [6],
#              TESSERA_TLS_DIR [/tls] (CA and server keys; $TESSERA_CERTS gets ca.crt
#              and keys/ only)
#   register, run: TESSERA_CONTROL [superlink:9093]
#   run:       TESSERA_APP [/app], TESSERA_OUTPUT_DIR [/results], TESSERA_STRATEGY,
#              TESSERA_ROUNDS, TESSERA_DATASET, TESSERA_NUM_CLIENTS (min-nodes),
#              TESSERA_TRAIN_TIME_BUDGET, TESSERA_MEMORY_FRACTION,
#              TESSERA_RUN_NAME [compose-<UTC time>],
#              TESSERA_RUN_CONFIG (more overrides, last wins), TESSERA_RUN_TIMEOUT [1800]
set -euo pipefail

log() { printf '[tessera-entrypoint] %s\n' "$*" >&2; }
die() {
    printf '[tessera-entrypoint] error: %s\n' "$*" >&2
    exit 1
}

truthy() { # truthy VALUE: true for 1/true/yes/on (any case)
    case "$(printf '%s' "${1:-}" | tr '[:upper:]' '[:lower:]')" in
        1 | true | yes | on) return 0 ;;
        *) return 1 ;;
    esac
}

CERTS="${TESSERA_CERTS:-/certs}"
HEALTH_PORT="${TESSERA_HEALTH_PORT:-8081}"
HEALTH_FILE=/tmp/tessera-health
TLS=1
truthy "${TESSERA_TLS:-true}" || TLS=0
AUTH=0
truthy "${TESSERA_SUPERNODE_AUTH:-false}" && AUTH=1

need_file() { # need_file PATH HINT
    [ -r "$1" ] || die "$1 is missing or unreadable; $2"
}

health() { # health ADDR...: what tessera-healthcheck probes (the health server first)
    printf '%s\n' "127.0.0.1:$HEALTH_PORT" "$@" >"$HEALTH_FILE"
}

flwr_config() { # write $FLWR_HOME/config.toml with the connection "tessera"
    local control="${TESSERA_CONTROL:-superlink:9093}"
    mkdir -p "$FLWR_HOME"
    {
        printf '[superlink]\ndefault = "tessera"\n\n[superlink.tessera]\n'
        printf 'address = "%s"\n' "$control"
        if [ "$TLS" = 1 ]; then
            need_file "$CERTS/ca.crt" "run the init service first (docker compose up init)"
            printf 'root-certificates = "%s"\n' "$CERTS/ca.crt"
        else
            printf 'insecure = true\n'
        fi
    } >"$FLWR_HOME/config.toml"
}

role_superlink() {
    local tls=(--insecure) auth=()
    if [ "$TLS" = 1 ]; then
        need_file "$CERTS/server.key" "run the init service first (docker compose up init)"
        tls=(--ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.pem"
            --ssl-keyfile "$CERTS/server.key")
    else
        log "TLS is off (TESSERA_TLS=false): Fleet and Control APIs are plaintext"
    fi
    if [ "$AUTH" = 1 ]; then
        [ "$TLS" = 1 ] || die "TESSERA_SUPERNODE_AUTH=true needs TLS (TESSERA_TLS=true)"
        auth=(--enable-supernode-auth)
    fi
    health 127.0.0.1:9091 127.0.0.1:9092 127.0.0.1:9093
    exec flower-superlink "${tls[@]}" "${auth[@]}" --isolation process \
        --database "${TESSERA_DATABASE:-/data/state.db}" \
        --serverappio-api-address 0.0.0.0:9091 --fleet-api-address 0.0.0.0:9092 \
        --control-api-address 0.0.0.0:9093 \
        --health-server-address "127.0.0.1:$HEALTH_PORT" "$@"
}

role_supernode() {
    local tls=(--insecure) auth=() key
    [ -n "${TESSERA_NODE_CONFIG:-}" ] \
        || die "TESSERA_NODE_CONFIG is empty; set e.g. 'partition-id=0 num-partitions=3'"
    if [ "$TLS" = 1 ]; then
        need_file "$CERTS/ca.crt" "mount the CA certificate of the SuperLink at $CERTS/ca.crt"
        tls=(--root-certificates "$CERTS/ca.crt")
    fi
    if [ "$AUTH" = 1 ]; then
        key="${TESSERA_NODE_KEY:-$CERTS/keys/node-1}"
        need_file "$key" "set TESSERA_NODE_KEY to this node's private key (init makes keys/node-N)"
        auth=(--auth-supernode-private-key "$key")
    fi
    health 127.0.0.1:9094
    log "SuperNode -> ${TESSERA_SUPERLINK:-superlink:9092} ($([ "$TLS" = 1 ] && echo TLS || echo plaintext)$([ "$AUTH" = 1 ] && echo ', authenticated')), node-config: $TESSERA_NODE_CONFIG"
    local launcher=(python /usr/local/lib/tessera/supernode.py)
    case "${TESSERA_SUPERNODE:-tessera}" in
        tessera) ;;
        flower) launcher=(flower-supernode) ;;
        *) die "TESSERA_SUPERNODE is '$TESSERA_SUPERNODE'; use tessera or flower" ;;
    esac
    exec "${launcher[@]}" "${tls[@]}" "${auth[@]}" --isolation process \
        --superlink "${TESSERA_SUPERLINK:-superlink:9092}" \
        --clientappio-api-address 0.0.0.0:9094 \
        --node-config "$TESSERA_NODE_CONFIG" \
        --health-server-address "127.0.0.1:$HEALTH_PORT" "$@"
}

role_executor() { # role_executor serverapp|clientapp
    local plugin="$1" appio
    shift
    if [ "$plugin" = serverapp ]; then
        appio="${TESSERA_APPIO:-superlink:9091}"
    else
        appio="${TESSERA_APPIO:-}"
        [ -n "$appio" ] || die "TESSERA_APPIO is empty; set the SuperNode's ClientAppIo address, e.g. supernode-1:9094"
    fi
    mkdir -p "$FLWR_HOME" "${MPLCONFIGDIR:-/tmp/matplotlib}"
    health
    # The AppIo link stays on the container network: plaintext, token-protected.
    if [ "$plugin" = clientapp ]; then
        case "${TESSERA_EXECUTOR:-tessera}" in
            tessera)
                exec python /usr/local/lib/tessera/executor.py --insecure \
                    --appio-api-address "$appio" \
                    --health-server-address "127.0.0.1:$HEALTH_PORT" "$@"
                ;;
            flower) ;;
            *) die "TESSERA_EXECUTOR is '$TESSERA_EXECUTOR'; use tessera or flower" ;;
        esac
    fi
    exec flower-superexec --insecure --plugin-type "$plugin" --appio-api-address "$appio" \
        --health-server-address "127.0.0.1:$HEALTH_PORT" "$@"
}

fix_results_owner() { # as root: hand a Docker-made (root-owned) results folder to TESSERA_UID
    local dir="${TESSERA_OUTPUT_DIR:-/results}" uid="${TESSERA_UID:-1000}" gid="${TESSERA_GID:-1000}"
    [ -d "$dir" ] || return 0
    if [ "$(stat -c %u "$dir")" = 0 ] && [ "$uid" != 0 ] \
        && [ -z "$(find "$dir" -mindepth 1 -maxdepth 1 -print -quit)" ]; then
        chown "$uid:$gid" "$dir"
        log "results folder: handed the empty, root-owned $dir to uid $uid"
    fi
    setpriv --reuid="$uid" --regid="$gid" --clear-groups test -w "$dir" \
        || die "the results folder (mounted at $dir) is owned by uid $(stat -c %u "$dir") and" \
            "not writable by uid $uid; set TESSERA_UID=\$(id -u) and TESSERA_GID=\$(id -g)" \
            "in .env, or chown the folder"
}

role_init() {
    if [ "$(id -u)" = 0 ]; then
        fix_results_owner
        # Everything else as the image's user, so that the volumes' files are theirs.
        exec setpriv --reuid=tessera --regid=tessera --clear-groups \
            env HOME=/home/tessera "$0" init "$@"
    fi
    local names="${TESSERA_TLS_NAMES:-superlink,localhost,127.0.0.1}"
    local private="${TESSERA_TLS_DIR:-/tls}"
    # The CA key and the server key stay in $private (the SuperLink's volume); the
    # nodes' volume ($CERTS) gets the CA certificate and the node keys only.
    bash /opt/tessera/scripts/gen-certs.sh --out "$private" --names "$names"
    cp -f "$private/ca.crt" "$CERTS/ca.crt"
    chmod 644 "$CERTS/ca.crt"
    # SuperNode keys (ECDSA P-384, OpenSSH format, as `ssh-keygen -t ecdsa -b 384` makes).
    python3 - "$CERTS/keys" "${TESSERA_NODE_KEYS:-6}" <<'PY'
import os, sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

folder, count = sys.argv[1], int(sys.argv[2])
os.makedirs(folder, exist_ok=True)
made = []
for i in range(1, count + 1):
    private = os.path.join(folder, f"node-{i}")
    if os.path.exists(private) and os.path.exists(private + ".pub"):
        continue
    key = ec.generate_private_key(ec.SECP384R1())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()))
    with open(private + ".pub", "wb") as fh:
        fh.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                               serialization.PublicFormat.OpenSSH)
                 + f" tessera-node-{i}\n".encode())
    made.append(f"node-{i}")
print(f"[tessera-entrypoint] node keys in {folder}: "
      + (f"made {', '.join(made)}" if made else "all present"), file=sys.stderr)
PY
}

role_register() {
    if [ "$AUTH" = 0 ]; then
        log "SuperNode authentication is off (TESSERA_SUPERNODE_AUTH=false); nothing to register"
        return 0
    fi
    flwr_config
    local pub out count=0 listed
    listed="$(flwr supernode list tessera --format json 2>/dev/null || true)"
    for pub in "$CERTS"/keys/*.pub; do
        [ -f "$pub" ] || die "no public keys in $CERTS/keys; run the init service first"
        # A key the SuperLink (its --database) already knows is kept.
        if [ -n "$listed" ] && grep -qF "$(cut -d' ' -f2 "$pub")" <<<"$listed"; then
            continue
        fi
        if out="$(flwr supernode register "$pub" tessera 2>&1)"; then
            count=$((count + 1))
        elif grep -qi "already" <<<"$out"; then
            :
        else
            printf '%s\n' "$out" >&2
            die "could not register $pub"
        fi
    done
    log "registered $count new SuperNode key(s) with ${TESSERA_CONTROL:-superlink:9093}"
}

role_run() {
    local app="${TESSERA_APP:-/app}" out="${TESSERA_OUTPUT_DIR:-/results}"
    local name="${TESSERA_RUN_NAME:-}" rounds="${TESSERA_ROUNDS:-}"
    need_file "$app/pyproject.toml" "mount the Tessera checkout at $app"
    [ -n "$name" ] || name="compose-$(date -u +%Y%m%d-%H%M%S)"
    local cfg=("output-dir='$out'" "run-name='$name'")
    [ -z "${TESSERA_STRATEGY:-}" ] || cfg+=("strategy='$TESSERA_STRATEGY'")
    [ -z "$rounds" ] || cfg+=("num-server-rounds=$rounds")
    [ -z "${TESSERA_DATASET:-}" ] || cfg+=("dataset='$TESSERA_DATASET'")
    [ -z "${TESSERA_NUM_CLIENTS:-}" ] || cfg+=("min-nodes=$TESSERA_NUM_CLIENTS")
    [ -z "${TESSERA_TRAIN_TIME_BUDGET:-}" ] || cfg+=("train-time-budget=$TESSERA_TRAIN_TIME_BUDGET")
    [ -z "${TESSERA_MEMORY_FRACTION:-}" ] || cfg+=("memory-fraction=$TESSERA_MEMORY_FRACTION")
    local args=(--run-config "${cfg[*]}")
    [ -z "${TESSERA_RUN_CONFIG:-}" ] || args+=(--run-config "$TESSERA_RUN_CONFIG")
    flwr_config
    local results="$out/$name"
    [ ! -s "$results/metrics.jsonl" ] \
        || die "$results already holds a run; set another TESSERA_RUN_NAME or remove it"
    log "flwr run $app -> ${TESSERA_CONTROL:-superlink:9093}: ${cfg[*]} ${TESSERA_RUN_CONFIG:-}"
    local rc=0
    timeout "${TESSERA_RUN_TIMEOUT:-1800}" flwr run "$app" tessera --stream "${args[@]}" "$@" || rc=$?
    [ "$rc" != 124 ] || die "the run did not finish within TESSERA_RUN_TIMEOUT=${TESSERA_RUN_TIMEOUT:-1800}s"
    [ "$rc" = 0 ] || die "flwr run exited with status $rc"
    python3 - "$results" <<'PY'
import json, sys
from pathlib import Path

d = Path(sys.argv[1])
summary = d / "summary.json"
if not summary.is_file():
    sys.exit(f"[tessera-entrypoint] error: the run wrote no {summary}")
s = json.loads(summary.read_text())
config = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
want = config.get("run_config", {}).get("num-server-rounds")
lines = (d / "metrics.jsonl").read_text().splitlines() if (d / "metrics.jsonl").is_file() else []
for line in lines:
    r = json.loads(line)
    archs = ", ".join(sorted({f"{c['arch']}" for c in r.get("clients", [])}))
    print(f"  round {r['round']}: {r.get('num_ok')}/{r.get('num_sent')} ok, "
          f"{r['round_seconds']:.1f} s, personalised accuracy "
          f"{r.get('personal_accuracy_mean') or float('nan'):.3f}, archs {archs}")
nodes = config.get("nodes")  # a list of node records; flwr-fedavg writes a count
for n in nodes if isinstance(nodes, list) else []:
    if not isinstance(n, dict):
        continue
    p = n.get("profile", {})
    print(f"  node {n.get('partition_id')}: {p.get('name')} profile, "
          f"{p.get('cpu-cores', 0):.2f} cores, {p.get('memory-bytes', 0) / 2**20:.0f} MiB, "
          f"{p.get('train-macs-per-second', 0):.3g} MAC/s -> {n.get('arch')}")
if want is not None and len(lines) != int(want):
    sys.exit(f"[tessera-entrypoint] error: {len(lines)} of {want} rounds in {d}/metrics.jsonl")
print(f"[tessera-entrypoint] run finished: {len(lines)} round(s), archs "
      f"{', '.join(s.get('archs', []))}; results in {d}", file=sys.stderr)
PY
}

case "${1:-}" in
    superlink) shift; role_superlink "$@" ;;
    supernode) shift; role_supernode "$@" ;;
    serverapp) shift; role_executor serverapp "$@" ;;
    clientapp) shift; role_executor clientapp "$@" ;;
    init) shift; role_init "$@" ;;
    register) shift; role_register "$@" ;;
    run) shift; role_run "$@" ;;
    -h | --help | '')
        awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
        ;;
    *) exec "$@" ;;
esac
