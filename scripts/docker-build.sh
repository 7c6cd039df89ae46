#!/usr/bin/env bash
# Build Tessera's Docker images: tessera/flower (SuperLink, SuperNode, the one-shot
# init/register/run services), tessera/app-cpu (the ClientApp executor) and
# tessera/app-server (the ServerApp executor: app-cpu plus the ensemble's optimisers
# and numba, docker/requirements-server.txt).
#
# Usage: scripts/docker-build.sh [--base official|local|IMAGE] [--wheelhouse|--no-wheelhouse]
#                                [--platform linux/amd64|linux/arm64] [--tag TAG]
#                                [--flwr-version V] [--torch-version V]
#                                [--only flower|app|server]
#
#   --base official  FROM python:3.11-slim-bookworm (default; needs a registry)
#   --base local     FROM tessera/base:bookworm, made here with debootstrap from the
#                    host's Debian mirror when missing (machines with no registry)
#   --base IMAGE     FROM any Debian-like image with python3.11, python3-venv, useradd
#   --wheelhouse     install only from a wheelhouse that the host downloads (pip
#                    download) and serves to the build on 127.0.0.1, so that the build
#                    itself reaches no registry (default with --base local)
#   --no-wheelhouse  let pip in the build reach PyPI (and the PyTorch CPU index)
#   --platform P     target platform; the wheelhouse is downloaded for it. Building
#                    for another architecture than the engine's needs buildx/QEMU:
#                    see docker/README.md
#   --tag TAG        image tag (default latest)
#   --only NAME      build one image
#
# Idempotent and cached: the base image is made once; the wheelhouse lives in
# $TESSERA_DOCKER_CACHE (default ~/.cache/tessera-docker) and is downloaded again
# only when a pin changes; docker's layer cache does the rest (the wheelhouse URL is
# a build argument: it is served on a fixed port, TESSERA_WHEELHOUSE_PORT [38765],
# so that it stays the same). Builds use the
# classic builder (DOCKER_BUILDKIT=0) unless DOCKER_BUILDKIT is set, because a
# registry-less machine cannot fetch BuildKit's frontend or the buildx plugin.
# Prints the time of each step.
set -euo pipefail

LOG_PREFIX=docker-build
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

usage() { # the comment block at the top of this file
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
}

OFFICIAL_BASE=python:3.11-slim-bookworm
LOCAL_BASE=tessera/base:bookworm
IMAGE_PYTHON=3.11 # the Python of both bases (bookworm's python3 is 3.11)

base=official
wheelhouse=""
platform=""
tag=latest
flwr_version=1.30.0
torch_version=2.13.0
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --base) [ $# -ge 2 ] || die "--base needs official, local or an image"; base="$2"; shift 2 ;;
        --base=*) base="${1#*=}"; shift ;;
        --wheelhouse) wheelhouse=1; shift ;;
        --no-wheelhouse) wheelhouse=0; shift ;;
        --platform) [ $# -ge 2 ] || die "--platform needs e.g. linux/arm64"; platform="$2"; shift 2 ;;
        --platform=*) platform="${1#*=}"; shift ;;
        --tag) [ $# -ge 2 ] || die "--tag needs a tag"; tag="$2"; shift 2 ;;
        --tag=*) tag="${1#*=}"; shift ;;
        --flwr-version) [ $# -ge 2 ] || die "--flwr-version needs a version"; flwr_version="$2"; shift 2 ;;
        --flwr-version=*) flwr_version="${1#*=}"; shift ;;
        --torch-version) [ $# -ge 2 ] || die "--torch-version needs a version"; torch_version="$2"; shift 2 ;;
        --torch-version=*) torch_version="${1#*=}"; shift ;;
        --only) [ $# -ge 2 ] || die "--only needs flower, app or server"; only="$2"; shift 2 ;;
        --only=*) only="${1#*=}"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1'; see --help" ;;
    esac
done
case "$only" in
    '' | flower | app | server) ;;
    *) die "--only must be flower, app or server (got '$only')" ;;
esac

have docker || die "docker is not on PATH; install Docker (or run scripts/ci-docker.sh start)"
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
    || die "no Docker engine answers; start dockerd (scripts/ci-docker.sh start) or check DOCKER_HOST"

engine_arch="$(docker version --format '{{.Server.Arch}}')"
[ -n "$platform" ] || platform="linux/$engine_arch"
case "$platform" in
    linux/amd64) pip_arch=x86_64 ;;
    linux/arm64) pip_arch=aarch64 ;;
    *) die "--platform $platform is not supported; use linux/amd64 or linux/arm64" ;;
esac
[ "$platform" = "linux/$engine_arch" ] || warn "building $platform on a $engine_arch engine" \
    "needs binfmt/QEMU; the classic builder cannot cross-build (see docker/README.md)"

case "$base" in
    official) base_image="$OFFICIAL_BASE" ;;
    local) base_image="$LOCAL_BASE"; [ -n "$wheelhouse" ] || wheelhouse=1 ;;
    *) base_image="$base" ;;
esac
[ -n "$wheelhouse" ] || wheelhouse=0

export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"
CACHE="${TESSERA_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tessera-docker}"
mkdir -p "$CACHE"
started_at=$SECONDS
step_start=$SECONDS
step_done() { log "$1 took $((SECONDS - step_start)) s"; step_start=$SECONDS; }

# --------------------------------------------------------------- base image
debian_mirror() { # the first Debian mirror URI configured for apt on this host
    local f uri=""
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        uri="$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i ~ /debian\/?$/) { print $i; exit } }' "$f")"
        [ -n "$uri" ] && break
    done
    if [ -z "$uri" ]; then
        uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$1 == "deb" && $3 ~ /^bookworm$/ { print $2; exit }')"
    fi
    [ -n "$uri" ] || return 1
    printf '%s\n' "$uri"
}

build_local_base() {
    if docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        log "base image $LOCAL_BASE exists"
        return 0
    fi
    [ "$platform" = "linux/$engine_arch" ] \
        || die "--base local makes a $engine_arch base only; use --base official for $platform"
    local debootstrap mirror root
    debootstrap="$(command -v debootstrap || echo /usr/sbin/debootstrap)"
    [ -x "$debootstrap" ] || die "debootstrap is missing: apt-get install debootstrap" \
        "(scripts/ci-docker.sh start installs it)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root; run as root or use --base official"
    mirror="$(debian_mirror)" || die "no Debian mirror in /etc/apt/sources.list*; cannot debootstrap"
    root="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    # shellcheck disable=SC2064 # expand now: the trap must remove this very folder
    trap "rm -rf '$root'" EXIT
    log "debootstrap bookworm from $mirror (about a minute)"
    "$debootstrap" --variant=minbase \
        --include=python3,python3-venv,ca-certificates,passwd,openssl \
        bookworm "$root" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail_log "$CACHE/debootstrap.log" 30; die "debootstrap failed; see $CACHE/debootstrap.log"; }
    # Leave no package caches or lists in the image.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/var/log/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$LOCAL_BASE" >/dev/null
    rm -rf "$root"
    trap - EXIT
    log "imported $LOCAL_BASE ($(docker image inspect -f '{{.Size}}' "$LOCAL_BASE" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
}

if [ "$base" = local ]; then
    build_local_base
    step_done "base image"
fi

# --------------------------------------------------------------- wheelhouse
# Downloaded on the host (which reaches the registry) for the image's Python and the
# target platform, then served to the build over HTTP on 127.0.0.1 (the build runs
# with --network host): pip installs from it with --no-index, and the wheels never
# become an image layer.
wheel_dir=""
fill_wheelhouse() {
    local py key stamp
    py="$(tessera_python)" || die "no python3 on the host to download the wheelhouse"
    key="$(cat "$TESSERA_ROOT/docker/requirements-app.txt" \
        "$TESSERA_ROOT/docker/requirements-server.txt" | sha256sum | cut -c1-12)"
    key="py$IMAGE_PYTHON-$pip_arch-flwr$flwr_version-torch$torch_version-$key"
    wheel_dir="$CACHE/wheelhouse-$key"
    stamp="$wheel_dir/.complete"
    if [ -f "$stamp" ]; then
        log "wheelhouse $wheel_dir is up to date"
        return 0
    fi
    log "downloading the wheelhouse for $platform, Python $IMAGE_PYTHON into $wheel_dir"
    rm -rf "$wheel_dir"
    mkdir -p "$wheel_dir"
    local plat=() tagged
    for tagged in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux2014 \
        manylinux_2_17 manylinux2010 manylinux1; do
        plat+=(--platform "${tagged}_$pip_arch")
    done
    plat+=(--platform "linux_$pip_arch")
    # Pure-Python packages published as source only (the ensemble's smac and its
    # pynisher): built into wheels here first, so the binary-only download finds them.
    grep -E '^(smac|pynisher)==' "$TESSERA_ROOT/docker/requirements-server.txt" \
        >"$CACHE/source-only.txt"
    "$py" -m pip wheel --no-deps --wheel-dir "$wheel_dir" -r "$CACHE/source-only.txt" \
        >"$CACHE/wheelhouse.log" 2>&1 \
        || { tail -n 20 "$CACHE/wheelhouse.log" >&2
            die "building wheels of the source-only packages failed (log $CACHE/wheelhouse.log)"; }
    # TESSERA_TORCH_INDEX_URL: where to find a CPU torch when pip's own configuration
    # (find-links, index) has none, e.g. https://download.pytorch.org/whl/cpu.
    "$py" -m pip download --dest "$wheel_dir" --only-binary=:all: --find-links "$wheel_dir" \
        --python-version "$IMAGE_PYTHON" --implementation cp "${plat[@]}" \
        ${TESSERA_TORCH_INDEX_URL:+--extra-index-url "$TESSERA_TORCH_INDEX_URL"} \
        "flwr==$flwr_version" "torch==$torch_version" -r "$TESSERA_ROOT/docker/requirements-app.txt" \
        -r "$TESSERA_ROOT/docker/requirements-server.txt" \
        >>"$CACHE/wheelhouse.log" 2>&1 \
        || { grep -v '^WARNING: Location' "$CACHE/wheelhouse.log" | tail -n 20 >&2
            die "pip download failed (above; log $CACHE/wheelhouse.log): a package without a" \
                "wheel for $platform and Python $IMAGE_PYTHON cannot go into the wheelhouse"; }
    local torch_wheel
    torch_wheel="$(find "$wheel_dir" -name "torch-$torch_version*.whl" -printf '%f\n' | head -n 1)"
    [ -n "$torch_wheel" ] || die "no torch $torch_version wheel in $wheel_dir"
    if find "$wheel_dir" -name 'nvidia_*.whl' | grep -q .; then
        die "the wheelhouse got a CUDA torch ($torch_wheel) with NVIDIA libraries (GBs);" \
            "set TESSERA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu and" \
            "--torch-version $torch_version+cpu, or put a CPU wheel in pip's find-links"
    fi
    touch "$stamp"
    log "wheelhouse: $(find "$wheel_dir" -name '*.whl' | wc -l) wheels," \
        "$(du -sh "$wheel_dir" | cut -f1), torch: $torch_wheel"
}

server_pid=""
stop_server() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
trap stop_server EXIT

serve_wheelhouse() { # serve $wheel_dir on a free loopback port; sets wheel_url
    local py port
    py="$(tessera_python)"
    # A fixed port keeps the build argument, and so docker's cache, stable; any free
    # port when it is taken.
    port="$("$py" - "${TESSERA_WHEELHOUSE_PORT:-38765}" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
PY
)"
    "$py" -m http.server --bind 127.0.0.1 --directory "$wheel_dir" "$port" \
        >"$CACHE/wheelhouse-server.log" 2>&1 &
    server_pid=$!
    wheel_url="http://127.0.0.1:$port/"
    for _ in $(seq 1 50); do
        "$py" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=1)" \
            "$wheel_url" 2>/dev/null && return 0
        kill -0 "$server_pid" 2>/dev/null || break
        sleep 0.1
    done
    die "could not serve the wheelhouse on $wheel_url (log $CACHE/wheelhouse-server.log)"
}

wheel_url=""
if [ "$wheelhouse" = 1 ]; then
    fill_wheelhouse
    serve_wheelhouse
    step_done "wheelhouse"
fi

# ------------------------------------------------------------------- images
build() { # build NAME DOCKERFILE [--build-arg K=V]...
    local name="$1" dockerfile="$2"
    shift 2
    log "building $name:$tag from $base_image ($platform, flwr $flwr_version)"
    local args=(
        --file "$TESSERA_ROOT/docker/$dockerfile"
        --tag "$name:$tag"
        --build-arg "BASE_IMAGE=$base_image"
        --build-arg "FLWR_VERSION=$flwr_version"
        --build-arg "TORCH_VERSION=$torch_version"
        --build-arg "WHEELHOUSE_URL=$wheel_url"
        --label "org.opencontainers.image.version=$flwr_version"
        "$@"
    )
    if [ "$DOCKER_BUILDKIT" != 0 ] || [ "$platform" != "linux/$engine_arch" ]; then
        args+=(--platform "$platform")
    fi
    # The wheelhouse server listens on the host's loopback.
    [ -z "$wheel_url" ] || args+=(--network host)
    docker build "${args[@]}" "$TESSERA_ROOT" >"$CACHE/build-$(basename "$name").log" 2>&1 \
        || { tail_log "$CACHE/build-$(basename "$name").log" 40; die "building $name failed"; }
    log "$name:$tag: $(docker image inspect -f '{{.Size}}' "$name:$tag" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
}

if [ -z "$only" ] || [ "$only" = flower ]; then
    build tessera/flower flower.Dockerfile
    step_done "tessera/flower"
fi
if [ -z "$only" ] || [ "$only" = app ]; then
    build tessera/app-cpu app.Dockerfile
    step_done "tessera/app-cpu"
fi
if [ -z "$only" ] || [ "$only" = server ]; then
    build tessera/app-server app.Dockerfile --build-arg SERVER_EXTRAS=true
    step_done "tessera/app-server"
fi
# Drop the dangling images that rebuilds leave behind (not the layer cache of the
# current images).
docker image prune --force --filter "label=org.opencontainers.image.vendor=Tessera" >/dev/null || true
log "done in $((SECONDS - started_at)) s"
