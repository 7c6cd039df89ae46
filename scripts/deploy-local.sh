#!/usr/bin/env bash
# Run Tessera as a real Flower deployment on this machine: one SuperLink and N
# SuperNodes talking gRPC over loopback, TLS by default, then `flwr run` the app.
#
# Usage: scripts/deploy-local.sh --nodes N [--run-config "k=v ..."]
#            [--profiles "cpu-small,cpu-large,jetson-orin"] [--insecure]
#            [--workdir DIR] [--timeout SECONDS] [--resume]
#            [--node-config "I:k=v ..."]... [--isolation subprocess|process]
#            [--executor tessera|flower] [--supernode tessera|flower]
#
#   --nodes N         number of SuperNodes; node i gets node-config
#                     partition-id=i num-partitions=N device-profile=<profile>
#                     state-dir=<workdir>/node-state/i (its state survives restarts)
#   --run-config STR  run-config overrides, as for `flwr run` (or a .toml file);
#                     output-dir defaults to <repo>/results, run-name to
#                     deploy-<UTC time>, min-nodes to N
#   --profiles CSV    device profiles given to the nodes round-robin
#                     (default cpu-small,cpu-large,jetson-orin)
#   --insecure        plaintext gRPC instead of TLS
#   --workdir DIR     certificates, FLWR_HOME, SuperLink state and logs
#                     (default <repo>/.deploy/<UTC time>-<pid>)
#   --timeout SECONDS bound on the whole deployment (default 900)
#   --node-config "I:k=v ..."  extra node-config for node I (repeatable), e.g.
#                     "2:attack='boost'" makes node 2 hostile (the attack harness)
#   --isolation MODE  how each SuperNode runs the ClientApp: process (default; a
#                     separate long-lived executor per node on the node's ClientAppIo
#                     port, as the compose cluster runs its ClientApp executor
#                     containers) or subprocess (the SuperNode starts Flower's
#                     flower-superexec itself); process with the tessera executor
#                     is about twice as fast a round (benchmarks/overhead.py)
#   --executor NAME   with --isolation process, each node's executor: tessera
#                     (default; `python -m tessera.executor`, which forks each
#                     message's ClientApp process from a fork server that imported
#                     torch and Flower once, and polls every 0.1 s) or flower
#                     (Flower's flower-superexec: a fresh flwr-clientapp process per
#                     message, polling every second)
#   --supernode NAME  how each SuperNode is started: tessera (default; `python -m
#                     tessera.supernode`, Flower's flower-supernode with its pull
#                     paced from 0.1 s after a message up to Flower's 3 s while idle,
#                     and its reply looked for every 0.05 s instead of 0.5 s) or
#                     flower (flower-supernode itself)
#   --resume          continue the run of an earlier deployment in the same --workdir
#                     and run-name: the SuperLink keeps its --database, the nodes their
#                     state, and the ServerApp gets run-config resume=<results folder>
#
# Every port is a free loopback port picked at start, so concurrent deployments
# and leftovers never collide. Every process started here (and its children:
# flower-superexec, flwr-serverapp, flwr-clientapp) is stopped on exit, also on
# failure or Ctrl-C. Exits non-zero unless the run wrote summary.json and one
# metrics.jsonl line per round.
set -euo pipefail

LOG_PREFIX=deploy-local
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

usage() { # the comment block at the top of this file
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
}

nodes=""
user_run_config=""
profiles="cpu-small,cpu-large,jetson-orin"
insecure=0
workdir=""
timeout_s=900
resume=0
isolation=process
executor=tessera
supernode=tessera
declare -A extra_node_config=()
add_node_config() { # "I:k=v ..."
    local index="${1%%:*}" rest="${1#*:}"
    case "$index" in '' | *[!0-9]*) die "--node-config needs I:k=v, got '$1'" ;; esac
    [ "$rest" != "$1" ] || die "--node-config needs I:k=v, got '$1'"
    extra_node_config[$index]="${extra_node_config[$index]:+${extra_node_config[$index]} }$rest"
}
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) [ $# -ge 2 ] || die "--nodes needs a number"; nodes="$2"; shift 2 ;;
        --nodes=*) nodes="${1#*=}"; shift ;;
        --run-config) [ $# -ge 2 ] || die "--run-config needs a value"
            user_run_config="${user_run_config:+$user_run_config }$2"; shift 2 ;;
        --run-config=*) user_run_config="${user_run_config:+$user_run_config }${1#*=}"; shift ;;
        --profiles) [ $# -ge 2 ] || die "--profiles needs a list"; profiles="$2"; shift 2 ;;
        --profiles=*) profiles="${1#*=}"; shift ;;
        --insecure) insecure=1; shift ;;
        --resume) resume=1; shift ;;
        --isolation) [ $# -ge 2 ] || die "--isolation needs subprocess or process"
            isolation="$2"; shift 2 ;;
        --isolation=*) isolation="${1#*=}"; shift ;;
        --executor) [ $# -ge 2 ] || die "--executor needs tessera or flower"
            executor="$2"; shift 2 ;;
        --executor=*) executor="${1#*=}"; shift ;;
        --supernode) [ $# -ge 2 ] || die "--supernode needs tessera or flower"
            supernode="$2"; shift 2 ;;
        --supernode=*) supernode="${1#*=}"; shift ;;
        --workdir) [ $# -ge 2 ] || die "--workdir needs a folder"; workdir="$2"; shift 2 ;;
        --workdir=*) workdir="${1#*=}"; shift ;;
        --timeout) [ $# -ge 2 ] || die "--timeout needs seconds"; timeout_s="$2"; shift 2 ;;
        --timeout=*) timeout_s="${1#*=}"; shift ;;
        --node-config) [ $# -ge 2 ] || die "--node-config needs I:k=v"; add_node_config "$2"; shift 2 ;;
        --node-config=*) add_node_config "${1#*=}"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1'; see --help" ;;
    esac
done
case "$nodes" in
    '' | *[!0-9]* | 0) die "--nodes must be a positive whole number (got '${nodes}')" ;;
esac
case "$isolation" in
    subprocess | process) ;;
    *) die "--isolation is '$isolation'; use subprocess or process" ;;
esac
case "$executor" in
    tessera | flower) ;;
    *) die "--executor is '$executor'; use tessera or flower" ;;
esac
case "$supernode" in
    tessera | flower) ;;
    *) die "--supernode is '$supernode'; use tessera or flower" ;;
esac
case "$timeout_s" in
    '' | *[!0-9]* | 0) die "--timeout must be a positive whole number of seconds (got '$timeout_s')" ;;
esac
started_at=$SECONDS
deadline=$((SECONDS + timeout_s))

# ------------------------------------------------------------------ environment
venv="$TESSERA_ROOT/.venv"
if [ ! -x "$venv/bin/flower-superlink" ]; then
    if [ -x "$TESSERA_ROOT/scripts/setup.sh" ] || [ -f "$TESSERA_ROOT/scripts/setup.sh" ]; then
        log "no .venv with Flower yet; running scripts/setup.sh"
        bash "$TESSERA_ROOT/scripts/setup.sh"
    fi
    [ -x "$venv/bin/flower-superlink" ] \
        || die "$venv has no flower-superlink; create it (scripts/setup.sh, or" \
            "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]')"
fi
py="$venv/bin/python"
export PATH="$venv/bin:$PATH"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_TELEMETRY_ENABLED="${FLWR_TELEMETRY_ENABLED:-0}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning,ignore::DeprecationWarning}"

stamp="$(date -u +%Y%m%d-%H%M%S)"
[ -n "$workdir" ] || workdir="$TESSERA_ROOT/.deploy/$stamp-$$"
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"
logs="$workdir/logs"
certs="$workdir/certs"
export FLWR_HOME="$workdir/flwr-home"
mkdir -p "$logs" "$FLWR_HOME"
# SuperLink state of an earlier deployment in this folder would list its nodes;
# a resumed deployment keeps it (registrations, run history).
if [ "$resume" = 0 ]; then
    rm -f "$workdir/state.db" "$workdir/state.db-journal" "$workdir/state.db-wal" \
        "$workdir/state.db-shm"
    rm -rf "$workdir/node-state"
elif compgen -G "$logs/*.log" >/dev/null; then
    mkdir -p "$logs/before-resume-$stamp"
    mv "$logs"/*.log "$logs/before-resume-$stamp/"
fi

# ------------------------------------------------------------- process tracking
pgids=()   # process groups (one per component, each made by setsid)
tail_pid=""  # the `tail -f` that mirrors the run log to the terminal

# start_group LOGFILE CMD...: start CMD in a new session (so that it and all its
# children form one process group) with output to LOGFILE; sets $last_pgid.
start_group() {
    local logfile="$1" pid
    shift
    if have setsid; then
        setsid "$@" >"$logfile" 2>&1 </dev/null &
    else
        "$py" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
            "$@" >"$logfile" 2>&1 </dev/null &
    fi
    pid=$!
    # The child makes its session only once it runs setsid, some time after `&`
    # returns; until then no group $pid exists, and a check or a kill of the group
    # would take it for gone (and miss it). Wait until it leads its own group.
    local tries=0 pg
    while [ "$tries" -lt 500 ]; do
        pg="$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')"
        { [ -z "$pg" ] || [ "$pg" = "$pid" ]; } && break
        sleep 0.01
        tries=$((tries + 1))
    done
    last_pgid="$pid"
    pgids+=("$pid")
}

group_alive() { # group_alive PGID: true while any process of the group lives
    kill -0 -- "-$1" 2>/dev/null
}

# group_members: live (not zombie) processes, "pid command", in our process groups.
group_members() {
    local pgs=" ${pgids[*]:-} " pid pgid stat args
    ps -e -o pid= -o pgid= -o stat= -o args= 2>/dev/null | while read -r pid pgid stat args; do
        [[ "$stat" == Z* ]] && continue
        [[ "$pgs" == *" $pgid "* ]] && printf '%s %s\n' "$pid" "$args"
    done
    return 0
}

# Live processes ("pid command") left in the sessions we made, or Flower processes
# that name the workdir outside this script's own session (a Flower process that
# started a session of its own).
survivors() {
    local sids=" ${pgids[*]:-} " own pid sid stat args
    own="$(ps -o sid= -p $$ | tr -d ' ')"
    ps -e -o pid= -o sid= -o stat= -o args= 2>/dev/null | while read -r pid sid stat args; do
        [[ "$stat" == Z* ]] && continue # exited, waiting to be reaped
        if [[ "$sids" == *" $sid "* ]] || {
            [ "$sid" != "$own" ] && [[ "$args" == *"$workdir"* ]] \
                && [[ "$args" == *flower-* || "$args" == *flwr* ]]
        }; then
            printf '%s %s\n' "$pid" "$args"
        fi
    done
    return 0
}

cleanup() {
    local rc=$? pgid i left
    trap - EXIT INT TERM
    [ -z "$tail_pid" ] || kill "$tail_pid" 2>/dev/null || true
    if [ "${#pgids[@]}" -gt 0 ]; then
        log "stopping ${#pgids[@]} process group(s)"
        for pgid in "${pgids[@]}"; do kill -TERM -- "-$pgid" 2>/dev/null || true; done
        # Flower's components take 1-3 s to shut down gracefully.
        for i in $(seq 1 100); do
            left="$(group_members)"
            [ -z "$left" ] && break
            if [ "$i" = 50 ]; then
                log "still shutting down after 5 s (SIGKILL in 5 s):"
                printf '  %s\n' "$left" | cut -c1-160 >&2
            fi
            sleep 0.1
        done
        for pgid in "${pgids[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
        wait 2>/dev/null || true
        left="$(survivors)"
        if [ -n "$left" ]; then
            warn "processes escaped their group; killing them:"
            printf '%s\n' "$left" >&2
            printf '%s\n' "$left" | while read -r pid _; do kill -KILL "$pid" 2>/dev/null || true; done
            sleep 0.5
            left="$(survivors)"
            if [ -n "$left" ]; then
                printf '[%s] error: still alive after SIGKILL:\n%s\n' "$LOG_PREFIX" "$left" >&2
                [ "$rc" = 0 ] && rc=1
            fi
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'warn "interrupted"; exit 130' INT
trap 'warn "terminated"; exit 143' TERM

fail() { # fail MESSAGE: print the message and the end of every log, then exit 1
    local f
    printf '[%s] error: %s\n' "$LOG_PREFIX" "$*" >&2
    for f in "$logs"/superlink.log "$logs"/supernode-*.log "$logs"/flwr-run.log; do
        tail_log "$f" 25
    done
    printf '\n[%s] logs: %s\n' "$LOG_PREFIX" "$logs" >&2
    exit 1
}

remaining() { echo $((deadline - SECONDS)); }

# ---------------------------------------------------------------- run config
# Merge the user's overrides with the deployment's (absolute output-dir, run-name,
# min-nodes) and re-serialise them into one `--run-config` string.
resolved="$("$py" - "$user_run_config" "$nodes" "$TESSERA_ROOT" "$PWD" "$stamp" "$profiles" "$resume" <<'PY'
import os, sys

from flwr.common.config import parse_config_args

try:
    import tomllib
except ImportError:  # Python 3.10 (JetPack 6): flwr depends on tomli
    import tomli as tomllib

user, nodes, root, cwd, stamp, profiles, resume = sys.argv[1:8]
with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
    defaults = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
try:
    cfg = parse_config_args([user]) if user.strip() else {}
except Exception as err:  # click.ClickException, TOMLDecodeError, OSError
    sys.exit(f"--run-config {user!r}: {getattr(err, 'message', err)}")
unknown = sorted(set(cfg) - set(defaults))
if unknown:
    sys.exit(f"unknown run-config key(s) {', '.join(unknown)}; the keys are those of "
             "[tool.flwr.app.config] in pyproject.toml")
out = cfg.get("output-dir") or os.path.join(root, "results")
out = os.path.expanduser(str(out))
cfg["output-dir"] = os.path.normpath(out if os.path.isabs(out) else os.path.join(cwd, out))
if not str(cfg.get("run-name", "")).strip():
    cfg["run-name"] = f"deploy-{stamp}"
cfg.setdefault("min-nodes", int(nodes))
if resume == "1":
    cfg["resume"] = os.path.join(cfg["output-dir"], str(cfg["run-name"]))
rounds = cfg.get("num-server-rounds", defaults["num-server-rounds"])

def toml_value(key, value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    value = str(value)
    if "'" not in value and "\n" not in value:
        return f"'{value}'"
    if '"' not in value and "\\" not in value and "\n" not in value:
        return f'"{value}"'
    sys.exit(f"run-config '{key}' holds both quote characters; simplify it")

line = " ".join(f"{k}={toml_value(k, v)}" for k, v in cfg.items())
assert parse_config_args([line]) == cfg, (line, cfg)
try:
    from client_app.device import PREDEFINED_PROFILES
except Exception:  # the check is a courtesy; the ClientApp validates again
    PREDEFINED_PROFILES = None
if PREDEFINED_PROFILES is not None:
    bad = [p for p in profiles.split(",") if p.strip() and p.strip() not in PREDEFINED_PROFILES]
    if bad:
        sys.exit(f"unknown device profile(s) {', '.join(bad)} in --profiles; use "
                 f"{', '.join(PREDEFINED_PROFILES)}")
print(line)
print(cfg["output-dir"])
print(cfg["run-name"])
print(int(rounds))
PY
)" || die "bad --run-config or --profiles (see above)"
{
    IFS= read -r run_config
    IFS= read -r output_dir
    IFS= read -r run_name
    IFS= read -r num_rounds
} <<<"$resolved"
results="$output_dir/$run_name"
if [ "$resume" = 1 ]; then
    [ -s "$results/checkpoint.npz" ] \
        || die "--resume: $results has no checkpoint.npz; pass the run-name of the run to continue"
    log "resuming the run in $results"
else
    [ ! -s "$results/metrics.jsonl" ] \
        || die "$results already holds a run; pass another run-name in --run-config (or --resume)"
fi

IFS=',' read -r -a profile_list <<<"${profiles// /}"
[ "${#profile_list[@]}" -gt 0 ] || die "--profiles is empty"

# ---------------------------------------------------------------------- ports
read -r -a ports <<<"$("$py" - "$((3 + nodes))" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
PY
)"
serverappio_port="${ports[0]}"
fleet_port="${ports[1]}"
control_port="${ports[2]}"

# wait_ports PGID SECONDS PORT...: wait until every port accepts connections on
# 127.0.0.1 while the group lives.
wait_ports() {
    "$py" - "$@" <<'PY'
import os, socket, sys, time
pgid, limit, ports = int(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
deadline = time.monotonic() + limit
while ports:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(f"process group {pgid} exited before listening on {ports}")
    port = ports[0]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        ports.pop(0)
        continue
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"nothing listens on 127.0.0.1:{port} after {limit:g}s")
    time.sleep(0.1)
PY
}

# ---------------------------------------------------------------- certificates
tls_superlink=()
tls_supernode=()
if [ "$insecure" = 1 ]; then
    tls_superlink=(--insecure)
    tls_supernode=(--insecure)
    log "TLS is off (--insecure): traffic on loopback is plaintext"
else
    bash "$TESSERA_ROOT/scripts/gen-certs.sh" --out "$certs" --names "127.0.0.1,localhost"
    tls_superlink=(--ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.pem"
        --ssl-keyfile "$certs/server.key")
    tls_supernode=(--root-certificates "$certs/ca.crt")
fi

# ------------------------------------------------------------------ SuperLink
log "workdir $workdir"
log "SuperLink: ServerAppIo 127.0.0.1:$serverappio_port, Fleet 127.0.0.1:$fleet_port," \
    "Control 127.0.0.1:$control_port ($([ "$insecure" = 1 ] && echo plaintext || echo TLS))"
start_group "$logs/superlink.log" flower-superlink "${tls_superlink[@]}" \
    --serverappio-api-address "127.0.0.1:$serverappio_port" \
    --fleet-api-address "127.0.0.1:$fleet_port" \
    --control-api-address "127.0.0.1:$control_port" \
    --database "$workdir/state.db"
superlink_pgid="$last_pgid"
limit=$(($(remaining) < 60 ? $(remaining) : 60))
wait_ports "$superlink_pgid" "$limit" "$serverappio_port" "$fleet_port" "$control_port" \
    || fail "the SuperLink did not come up"

# Check what SuperNodes and `flwr` will see: a TLS handshake on the Fleet and Control
# APIs whose certificate chains to our CA and names 127.0.0.1.
if [ "$insecure" = 0 ]; then
    "$py" - "$certs/ca.crt" "$fleet_port" "$control_port" <<'PY' | tee "$logs/tls-check.log" >&2 \
        || fail "the SuperLink does not serve TLS with the generated certificate"
import socket, ssl, sys
ca, ports = sys.argv[1], [("Fleet", int(sys.argv[2])), ("Control", int(sys.argv[3]))]
for name, port in ports:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            print(f"TLS verified: {name} API 127.0.0.1:{port} speaks {tls.version()} "
                  f"(ALPN {tls.selected_alpn_protocol()}) with a certificate for 127.0.0.1 "
                  f"signed by {ca}")
    except (OSError, ssl.SSLError) as err:
        print(f"TLS check failed: {name} API 127.0.0.1:{port}: {err}")
        sys.exit(1)
PY
fi

# ------------------------------------------------------------------ SuperNodes
if [ "$supernode" = tessera ]; then
    supernode_cmd=("$py" -m tessera.supernode)
else
    supernode_cmd=(flower-supernode)
fi
for ((i = 0; i < nodes; i++)); do
    profile="${profile_list[$((i % ${#profile_list[@]}))]}"
    appio_port="${ports[$((3 + i))]}"
    log "SuperNode $i: partition $i/$nodes, profile $profile, ClientAppIo 127.0.0.1:$appio_port"
    mkdir -p "$workdir/node-state/$i"
    start_group "$logs/supernode-$i.log" "${supernode_cmd[@]}" "${tls_supernode[@]}" \
        --superlink "127.0.0.1:$fleet_port" \
        --clientappio-api-address "127.0.0.1:$appio_port" \
        --isolation "$isolation" \
        --node-config "partition-id=$i num-partitions=$nodes device-profile='$profile' state-dir='$workdir/node-state/$i'${extra_node_config[$i]:+ ${extra_node_config[$i]}}"
    if [ "$isolation" = process ]; then
        # the node's ClientApp executor, a process of its own (compose: a container);
        # the ClientAppIo API is plaintext on loopback, as the SuperNode's own is
        node_pgid="$last_pgid"
        limit=$(($(remaining) < 60 ? $(remaining) : 60))
        wait_ports "$node_pgid" "$limit" "$appio_port" \
            || fail "SuperNode $i did not open its ClientAppIo API"
        if [ "$executor" = tessera ]; then
            start_group "$logs/clientapp-executor-$i.log" "$py" -m tessera.executor \
                --insecure --appio-api-address "127.0.0.1:$appio_port"
        else
            start_group "$logs/clientapp-executor-$i.log" flower-superexec --insecure \
                --plugin-type clientapp --appio-api-address "127.0.0.1:$appio_port"
        fi
    fi
done

# ------------------------------------------------------------- flwr connection
{
    printf '[superlink]\ndefault = "tessera-local"\n\n[superlink.tessera-local]\n'
    printf 'address = "127.0.0.1:%s"\n' "$control_port"
    if [ "$insecure" = 1 ]; then
        printf 'insecure = true\n'
    else
        printf 'root-certificates = "%s"\n' "$certs/ca.crt"
    fi
} >"$FLWR_HOME/config.toml"

# --------------------------------------------------------------------- the run
mkdir -p "$output_dir"
log "flwr run: $num_rounds round(s), results in $results"
run_started=$SECONDS
# flwr run builds the app from every file under the folder it is given: hand it the
# publishable files alone (tessera/app_stage.py: the same FAB, byte for byte), not a
# checkout whose .venv holds 80,000 files to walk (6-7 s).
(cd "$TESSERA_ROOT" && "$py" -m tessera.app_stage "$TESSERA_ROOT" "$workdir/app" >/dev/null) \
    || fail "could not stage the app from $TESSERA_ROOT into $workdir/app"
start_group "$logs/flwr-run.log" \
    flwr run "$workdir/app" tessera-local --stream --run-config "$run_config"
run_pid="$last_pgid"
# Mirror the streamed run log to the terminal while waiting.
tail -n +1 -f "$logs/flwr-run.log" >&2 &
tail_pid=$!

run_rc=""
while :; do
    if ! kill -0 "$run_pid" 2>/dev/null; then
        run_rc=0
        wait "$run_pid" || run_rc=$?
        break
    fi
    if ! group_alive "$superlink_pgid"; then
        fail "the SuperLink exited during the run"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        done_rounds="$(wc -l <"$results/metrics.jsonl" 2>/dev/null | tr -d ' ')" || true
        fail "the run did not finish within --timeout ${timeout_s}s" \
            "(${done_rounds:-0} of $num_rounds round(s) done)"
    fi
    sleep 0.5
done
sleep 0.3
kill "$tail_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true
tail_pid=""
run_seconds=$((SECONDS - run_started))

# ------------------------------------------------------------------ verification
[ "$run_rc" = 0 ] || fail "flwr run exited with status $run_rc"
[ -s "$results/summary.json" ] || fail "the run ended without writing $results/summary.json"
got_rounds="$(wc -l <"$results/metrics.jsonl" 2>/dev/null | tr -d ' ' || echo 0)"
[ "$got_rounds" = "$num_rounds" ] \
    || fail "$results/metrics.jsonl has ${got_rounds:-0} round(s), expected $num_rounds"

"$py" - "$results" <<'PY' >&2 || true
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
for line in (d / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    archs = ",".join(sorted({c["arch"] for c in r.get("clients", [])}))
    print(f"  round {r['round']}: {r.get('num_ok')}/{r.get('num_sent')} ok, "
          f"{r.get('num_failed', 0)} failed, {r.get('num_rejected', 0)} rejected, "
          f"{r['round_seconds']:.1f} s, personalised accuracy "
          f"{r.get('personal_accuracy_mean') or float('nan'):.3f}, archs {archs}")
PY
log "done in $((SECONDS - started_at)) s (run $run_seconds s)"
log "results: $results"
log "logs:    $logs"
