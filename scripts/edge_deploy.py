#!/usr/bin/env python3
r"""Deploy a Tessera client node to a Docker host: a SuperNode and its ClientApp executor.

The host is given by URL: ``ssh://user@host`` (uses your ``ssh`` client and its
config), ``tcp://host:2376`` with TLS (``--tls-ca/--tls-cert/--tls-key`` or
``DOCKER_CERT_PATH``), ``unix:///var/run/docker.sock``, or nothing for the local
engine (``DOCKER_HOST`` is honoured). The tool detects the host's CPU architecture and
whether the NVIDIA runtime is there (a Jetson: arm64 + ``nvidia``), picks the image
(``tessera/app-jetson`` there, ``tessera/app-cpu`` elsewhere, ``tessera/flower`` for
the SuperNode), checks from the host that the SuperLink address resolves, accepts
connections and presents a certificate the CA vouches for, then starts both containers
with the node config, the CA certificate (and the node's key) copied in, and a restart
policy. Anything it created is removed again when a step fails.

The node's state (device profile, personal model, scheme state) lives in a volume
mounted at ``/data`` in the ClientApp container, and the node config gets
``state-dir='/data/node-state'``, so the node continues where it was after the device
or its containers restart: a named volume ``tessera-<name>-state`` by default (kept by
``remove`` unless ``--purge``), or a host folder with ``--state-dir`` (writable by uid
1000, the images' user).

Examples
--------
::

    scripts/edge_deploy.py deploy --host ssh://pi@192.0.2.7 --name pi-1 \\
        --superlink 192.0.2.10:9092 --ca-cert ca.crt \\
        --node-config "partition-id=0 num-partitions=4"
    scripts/edge_deploy.py status --host ssh://pi@192.0.2.7
    scripts/edge_deploy.py logs --host ssh://pi@192.0.2.7 --name pi-1 --role clientapp
    scripts/edge_deploy.py remove --host ssh://pi@192.0.2.7 --name pi-1

Exit status: 0 on success, 1 when the deployment or a check failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
LABEL = "tessera.deploy"
ROLE_LABEL = "tessera.role"
IMAGE_UID = 1000  # the `tessera` user of the images
DEFAULT_TAG = "latest"
STATE_MOUNT = "/data"
"""Where the ClientApp container mounts the node's state volume (the images' /data
belongs to their user, so a new named volume does too)."""
STATE_DIR = f"{STATE_MOUNT}/node-state"
"""node-config ``state-dir`` inside the ClientApp container."""
FLOWER_IMAGE = "tessera/flower"
CPU_IMAGE = "tessera/app-cpu"
JETSON_IMAGE = "tessera/app-jetson"
DOCKERFILES = {
    FLOWER_IMAGE: "docker/flower.Dockerfile",
    CPU_IMAGE: "docker/app.Dockerfile",
    JETSON_IMAGE: "docker/app-jetson.Dockerfile",
}
# Docker's names for machine architectures (`docker info` -> image `Architecture`).
ARCH_ALIASES = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
}
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,40}$")


class DeployError(Exception):
    """A deployment step failed; the message says what to do."""


class UsageError(DeployError):
    """The command line is wrong (exit status 2)."""


# --------------------------------------------------------------------------- pure parts
@dataclass(frozen=True)
class HostInfo:
    """What the tool needs to know about a Docker host.

    Parameters
    ----------
    name : str
        Host name the engine reports.
    arch : str
        Docker architecture name (``amd64``, ``arm64``, ...).
    runtimes : tuple of str
        Container runtimes the engine offers (``runc``, ``nvidia``, ...).
    os : str
        Operating system description.
    """

    name: str
    arch: str
    runtimes: tuple[str, ...]
    os: str

    @property
    def has_nvidia(self) -> bool:
        """Whether the NVIDIA container runtime is installed."""
        return "nvidia" in self.runtimes

    @property
    def is_jetson(self) -> bool:
        """Whether this looks like a Jetson: arm64 with the NVIDIA runtime."""
        return self.arch == "arm64" and self.has_nvidia

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> HostInfo:
        """Build from the engine's ``docker info`` mapping.

        Parameters
        ----------
        info : dict
            ``DockerClient.info()``.

        Returns
        -------
        HostInfo
            The host description.
        """
        raw = str(info.get("Architecture", ""))
        return cls(
            name=str(info.get("Name", "?")),
            arch=ARCH_ALIASES.get(raw, raw),
            runtimes=tuple(sorted(info.get("Runtimes") or {})),
            os=str(info.get("OperatingSystem", "?")),
        )


@dataclass(frozen=True)
class ImagePlan:
    """Images and runtime of one node.

    Parameters
    ----------
    supernode : str
        Image of the SuperNode container.
    clientapp : str
        Image of the ClientApp executor container.
    runtime : str or None
        Container runtime of the executor (``nvidia`` on a Jetson).
    note : str
        Why these were chosen.
    """

    supernode: str
    clientapp: str
    runtime: str | None
    note: str


def plan_images(
    host: HostInfo,
    *,
    tag: str = DEFAULT_TAG,
    flower_image: str | None = None,
    app_image: str | None = None,
    gpu: str = "auto",
) -> ImagePlan:
    """Choose the images and the executor's runtime for a host.

    Parameters
    ----------
    host : HostInfo
        The target host.
    tag : str
        Tag of the default images.
    flower_image, app_image : str or None
        Explicit images; ``None`` picks the default for the host.
    gpu : str
        ``auto`` (the NVIDIA runtime on a Jetson), ``on`` (require it) or ``off``.

    Returns
    -------
    ImagePlan
        The plan.

    Raises
    ------
    DeployError
        If ``gpu="on"`` and the host has no NVIDIA runtime, or the architecture is
        one the images are not built for.
    """
    if host.arch not in ("amd64", "arm64"):
        raise DeployError(
            f"host {host.name} is {host.arch}; Tessera's images exist for amd64 and arm64 "
            "(a 64-bit OS on a Raspberry Pi 3/4/5 is arm64)"
        )
    if gpu not in ("auto", "on", "off"):
        raise UsageError(f"--gpu {gpu!r} is invalid; use auto, on or off")
    if gpu == "on" and not host.has_nvidia:
        raise DeployError(
            f"--gpu on, but host {host.name} has no 'nvidia' container runtime "
            f"(runtimes: {', '.join(host.runtimes) or 'none'}); install the NVIDIA "
            "Container Toolkit (JetPack ships it) or use --gpu off"
        )
    use_gpu = gpu == "on" or (gpu == "auto" and host.is_jetson)
    if use_gpu and host.arch == "arm64":
        default_app, note = JETSON_IMAGE, "arm64 with the NVIDIA runtime: Jetson image, CUDA"
    elif use_gpu:
        default_app = CPU_IMAGE
        note = (
            "amd64 with the NVIDIA runtime: the project has no x86 CUDA image; the CPU "
            "image runs with runtime nvidia (pass --app-image for a CUDA one)"
        )
    else:
        default_app = CPU_IMAGE
        note = f"{host.arch}" + (", NVIDIA runtime not used" if host.has_nvidia else ", CPU")
    return ImagePlan(
        supernode=flower_image or f"{FLOWER_IMAGE}:{tag}",
        clientapp=app_image or f"{default_app}:{tag}",
        runtime="nvidia" if use_gpu else None,
        note=note,
    )


def parse_superlink(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and check both parts.

    Parameters
    ----------
    address : str
        The SuperLink's Fleet API address as the device dials it.

    Returns
    -------
    tuple of (str, int)
        Host and port.

    Raises
    ------
    UsageError
        If the address has no port or the port is out of range.
    """
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\s\[\]]+):(\d+)", address.strip())
    if not match:
        raise UsageError(
            f"--superlink {address!r} is invalid; give host:port as the device dials it, "
            "e.g. 192.0.2.10:9092 or superlink.example.org:9092"
        )
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 0 < port < 65536:
        raise UsageError(f"--superlink port {port} is out of range (1-65535)")
    return host, port


def parse_node_config(text: str) -> dict[str, str]:
    """Check a ``--node-config`` string: space-separated ``key=value`` pairs.

    Parameters
    ----------
    text : str
        As ``flower-supernode --node-config`` takes it.

    Returns
    -------
    dict of str to str
        Keys and raw values.

    Raises
    ------
    UsageError
        If a pair has no ``=`` or an empty key, or neither ``partition-id`` with
        ``num-partitions`` nor ``data-path`` is set.
    """
    try:
        parts = shlex.split(text)
    except ValueError as err:
        raise UsageError(f"--node-config {text!r}: {err}") from None
    pairs: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UsageError(
                f"--node-config item {part!r} is not key=value; e.g. "
                '"partition-id=0 num-partitions=4"'
            )
        pairs[key] = value
    if "data-path" not in pairs and not {"partition-id", "num-partitions"} <= set(pairs):
        raise UsageError(
            "--node-config needs partition-id and num-partitions (or data-path), e.g. "
            '"partition-id=0 num-partitions=4"'
        )
    return pairs


def with_state_dir(node_config: str, state_dir: str = STATE_DIR) -> str:
    """Add ``state-dir`` to a ``--node-config`` string unless it already sets one.

    Parameters
    ----------
    node_config : str
        The user's ``--node-config``.
    state_dir : str
        The folder inside the ClientApp container.

    Returns
    -------
    str
        The node config the SuperNode gets.
    """
    if "state-dir" in parse_node_config(node_config):
        return node_config
    return f"{node_config.strip()} state-dir='{state_dir}'"


def state_volume(name: str, host_dir: str | None) -> tuple[str, bool]:
    """Return what to mount at ``/data`` for node ``name`` and whether it is a named volume.

    Parameters
    ----------
    name : str
        The node name (checked).
    host_dir : str | None
        ``--state-dir``: an absolute host folder; ``None`` for the named volume
        ``tessera-<name>-state``.

    Returns
    -------
    tuple[str, bool]
        The volume name or host folder, and ``True`` for a named volume.

    Raises
    ------
    UsageError
        If ``host_dir`` is not an absolute path.
    """
    if host_dir is None:
        return f"tessera-{name}-state", True
    if not host_dir.startswith("/"):
        raise UsageError(
            f"--state-dir {host_dir!r} must be an absolute folder on the device, e.g. "
            "/var/lib/tessera/pi-1 (writable by uid 1000)"
        )
    return host_dir, False


def check_name(name: str) -> str:
    """Check a node name (it prefixes container and network names).

    Parameters
    ----------
    name : str
        The node name.

    Returns
    -------
    str
        The name.

    Raises
    ------
    UsageError
        If it has other characters than lowercase letters, digits, ``_.-``.
    """
    if not NAME_RE.fullmatch(name):
        raise UsageError(
            f"--name {name!r} is invalid; use lowercase letters, digits, '_', '.', '-' "
            "(at most 41 characters), e.g. pi-1"
        )
    return name


def _tar(files: Sequence[tuple[str, bytes, int]]) -> bytes:
    """Pack ``(name, content, mode)`` files, owned by the images' user, into a tar."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(content), mode, int(time.time())
            info.uid = info.gid = IMAGE_UID
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


# The check run on the device, in a throw-away container of the SuperNode image.
PREFLIGHT = r"""
import json, os, socket, ssl, sys
host, port = os.environ["CHECK_HOST"], int(os.environ["CHECK_PORT"])
def done(ok, stage, **kw):
    print(json.dumps({"ok": ok, "stage": stage, **kw}))
    sys.exit(0 if ok else 3)
try:
    addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
except OSError as err:
    done(False, "resolve", error=str(err))
try:
    raw = socket.create_connection((host, port), timeout=float(os.environ["CHECK_TIMEOUT"]))
except OSError as err:
    done(False, "connect", address=addr, error=str(err) or type(err).__name__)
ca = os.environ.get("CHECK_CA", "")
if not ca:
    raw.close()
    done(True, "connect", address=addr, tls=None)
ctx = ssl.create_default_context(cadata=ca)
ctx.set_alpn_protocols(["h2"])
try:
    with ctx.wrap_socket(raw, server_hostname=host) as tls:
        done(True, "tls", address=addr, tls=tls.version())
except ssl.SSLCertVerificationError as err:
    done(False, "tls-verify", address=addr, error=err.verify_message or str(err))
except (ssl.SSLError, OSError) as err:
    done(False, "tls", address=addr, error=str(err))
"""

PREFLIGHT_HINTS = {
    "resolve": "the device cannot resolve {host}: use an IP address or a name its DNS knows",
    "connect": (
        "nothing accepts connections at {host}:{port} from the device: is the SuperLink "
        "up, is its Fleet port published on an address the device reaches "
        "(TESSERA_BIND_ADDRESS=0.0.0.0), and does a firewall let it through?"
    ),
    "tls-verify": (
        "the SuperLink's certificate does not verify for {host} with {ca}: the name must "
        "be one of its subjectAltNames (scripts/gen-certs.sh --names ...,{host}) and "
        "--ca-cert must be the CA that signed it"
    ),
    "tls": (
        "TLS to {host}:{port} failed: is the SuperLink running with TLS? (--insecure if "
        "it deliberately is not)"
    ),
}


# ------------------------------------------------------------------------- engine
def connect(args: argparse.Namespace) -> Any:
    """Open and ping a Docker engine.

    Parameters
    ----------
    args : argparse.Namespace
        ``host``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``tls_verify``, ``timeout``.

    Returns
    -------
    docker.DockerClient
        A client that answered a ping.

    Raises
    ------
    DeployError
        If the URL is invalid, the host is unreachable, or access is denied.
    """
    try:
        import docker  # docker.tls and docker.errors come with it
    except ImportError:
        raise DeployError(
            "the 'docker' Python package is missing: pip install 'docker==7.*'"
        ) from None
    url = args.host or os.environ.get("DOCKER_HOST") or ""
    where = url or "the local Docker engine"
    try:
        if not url:
            client = docker.from_env(timeout=args.timeout)
        elif url.startswith("ssh://"):
            client = docker.DockerClient(base_url=url, use_ssh_client=True, timeout=args.timeout)
        elif url.startswith("tcp://"):
            tls: Any = False
            cert_path = os.environ.get("DOCKER_CERT_PATH", "")
            ca = args.tls_ca or (cert_path and os.path.join(cert_path, "ca.pem")) or None
            cert = args.tls_cert or (cert_path and os.path.join(cert_path, "cert.pem")) or None
            key = args.tls_key or (cert_path and os.path.join(cert_path, "key.pem")) or None
            if ca or cert or url.endswith(":2376"):
                for path in (ca, cert, key):
                    if not path or not os.path.isfile(path):
                        raise UsageError(
                            f"{url} uses TLS: give --tls-ca, --tls-cert and --tls-key (or "
                            f"DOCKER_CERT_PATH with ca.pem, cert.pem, key.pem); missing {path}"
                        )
                tls = docker.tls.TLSConfig(
                    client_cert=(str(cert), str(key)), ca_cert=ca, verify=args.tls_verify
                )
            client = docker.DockerClient(base_url=url, tls=tls, timeout=args.timeout)
        elif url.startswith("unix://"):
            client = docker.DockerClient(base_url=url, timeout=args.timeout)
        else:
            raise UsageError(
                f"--host {url!r} is invalid; use ssh://user@host, tcp://host:2376, "
                "unix:///var/run/docker.sock, or leave it out for the local engine"
            )
        client.ping()
    except UsageError:
        raise
    except Exception as err:  # docker.errors.DockerException, requests, OSError, ssh
        text = str(err)
        if "Permission denied" in text or isinstance(err, PermissionError):
            raise DeployError(
                f"no permission to use {where}: add the user to the 'docker' group "
                "(sudo usermod -aG docker $USER, then log in again) or run as root"
            ) from None
        raise DeployError(
            f"cannot reach {where}: {text.splitlines()[0] if text else type(err).__name__}. "
            "Check the URL, that dockerd runs there, and (ssh://) that `ssh user@host docker "
            "info` works without a password prompt"
        ) from None
    return client


def host_info(client: Any) -> HostInfo:
    """Describe the engine's machine.

    Parameters
    ----------
    client : docker.DockerClient
        A connected client.

    Returns
    -------
    HostInfo
        Architecture, runtimes, name.
    """
    return HostInfo.from_info(client.info())


def ensure_image(client: Any, ref: str, host: HostInfo, *, pull: str, build: bool) -> None:
    """Make sure ``ref`` is on the host, for its architecture.

    Parameters
    ----------
    client : docker.DockerClient
        The host's engine.
    ref : str
        Image reference.
    host : HostInfo
        The host.
    pull : str
        ``missing`` (pull when absent), ``always`` or ``never``.
    build : bool
        Build a missing Tessera image on the host from this checkout.

    Raises
    ------
    DeployError
        If the image is absent and cannot be built or pulled, or has another
        architecture than the host.
    """
    import docker.errors

    image = None
    if pull != "always":
        try:
            image = client.images.get(ref)
        except docker.errors.ImageNotFound:
            image = None
    if image is None and build:
        repo = ref.rsplit(":", 1)[0]
        dockerfile = DOCKERFILES.get(repo)
        if dockerfile is None:
            raise DeployError(f"--build knows Tessera's images only ({', '.join(DOCKERFILES)})")
        print(f"building {ref} on {host.name} from {dockerfile} (this takes a while)")
        try:
            image, _ = client.images.build(
                path=str(REPO_ROOT), dockerfile=dockerfile, tag=ref, rm=True, forcerm=True
            )
        except (docker.errors.BuildError, docker.errors.APIError) as err:
            raise DeployError(f"building {ref} on {host.name} failed: {err}") from None
    if image is None and pull != "never":
        try:
            image = client.images.pull(ref)
        except docker.errors.DockerException as err:
            image = None
            reason = str(err).splitlines()[0]
        else:
            reason = ""
        if image is None:
            raise DeployError(
                f"image {ref} is not on {host.name} and could not be pulled ({reason}); "
                "build it there (--build, or scripts/docker-build.sh on the host), push it "
                f"to a registry the host reaches, or copy it: docker save {ref} | ssh HOST "
                "docker load"
            )
    if image is None:
        raise DeployError(
            f"image {ref} is not on {host.name} (and --pull never): build it there with "
            f"--build or scripts/docker-build.sh, or copy it: docker save {ref} | ssh HOST "
            "docker load"
        )
    arch = ARCH_ALIASES.get(image.attrs.get("Architecture", ""), image.attrs.get("Architecture"))
    if arch and arch != host.arch:
        raise DeployError(
            f"image {ref} on {host.name} is for {arch} but the host is {host.arch}; build "
            f"it for linux/{host.arch} (docker buildx build --platform linux/{host.arch})"
        )


def _labelled(client: Any, name: str | None) -> tuple[list[Any], list[Any]]:
    """Containers and networks of one deployment (``name``) or of all."""
    selector = f"{LABEL}={name}" if name else LABEL
    containers = client.containers.list(all=True, filters={"label": selector})
    networks = client.networks.list(filters={"label": selector})
    return containers, networks


def _remove(client: Any, name: str) -> list[str]:
    """Remove every container and network labelled with deployment ``name``."""
    import docker.errors

    removed = []
    containers, networks = _labelled(client, name)
    for container in containers:
        try:
            container.remove(force=True)
            removed.append(f"container {container.name}")
        except docker.errors.NotFound:
            pass
    for network in networks:
        try:
            network.remove()
            removed.append(f"network {network.name}")
        except docker.errors.NotFound:
            pass
    return removed


def preflight(
    client: Any,
    image: str,
    *,
    name: str,
    superlink: tuple[str, int],
    ca_pem: str | None,
    ca_label: str,
    network: str | None,
    dns: Sequence[str],
    timeout: float,
) -> dict[str, Any]:
    """Check from the device that the SuperLink resolves, answers and (TLS) verifies.

    Parameters
    ----------
    client : docker.DockerClient
        The device's engine.
    image : str
        The SuperNode image (it has Python).
    name : str
        The deployment name (labels the throw-away container).
    superlink : tuple of (str, int)
        Host and port as the SuperNode will dial them.
    ca_pem : str or None
        The CA certificate; ``None`` for a plaintext SuperLink.
    ca_label : str
        How to name the CA in messages.
    network : str or None
        Docker network to check from (``None``: the default bridge).
    dns : Sequence of str
        DNS servers for the container (empty: the engine's default).
    timeout : float
        Connect timeout in seconds.

    Returns
    -------
    dict
        The check's report (``address``, ``tls``).

    Raises
    ------
    DeployError
        With the failed stage and what to do about it.
    """
    import docker.errors

    host, port = superlink
    env = {"CHECK_HOST": host, "CHECK_PORT": str(port), "CHECK_TIMEOUT": str(timeout)}
    if ca_pem:
        env["CHECK_CA"] = ca_pem
    container = client.containers.create(
        image,
        command=["python3", "-c", PREFLIGHT],
        environment=env,
        labels={LABEL: name, ROLE_LABEL: "preflight"},
        network=network,
        dns=list(dns) or None,
        healthcheck={"test": ["NONE"]},
    )
    try:
        container.start()
        status = container.wait(timeout=timeout + 30)
        output = container.logs(stdout=True, stderr=True).decode(errors="replace").strip()
    except Exception as err:  # requests timeout, engine errors
        raise DeployError(f"the SuperLink check on the device did not finish: {err}") from None
    finally:
        with contextlib.suppress(docker.errors.DockerException):
            container.remove(force=True)
    lines = output.splitlines()
    try:
        report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        report = {}
    if status.get("StatusCode") == 0 and report.get("ok"):
        return report
    stage = str(report.get("stage", "?"))
    hint = PREFLIGHT_HINTS.get(stage, "see the output above")
    raise DeployError(
        f"SuperLink {host}:{port} as seen from the device: {stage} failed "
        f"({report.get('error', output[-400:] or 'no output')}); "
        + hint.format(host=host, port=port, ca=ca_label)
    )


def _wait_running(client: Any, containers: Sequence[Any], seconds: float) -> None:
    """Wait until every container is running and healthy (or has no health check)."""
    deadline = time.monotonic() + seconds
    pending = list(containers)
    while pending:
        for container in list(pending):
            container.reload()
            state = container.attrs["State"]
            health = (state.get("Health") or {}).get("Status")
            if state["Status"] in ("exited", "dead") or container.attrs.get("RestartCount", 0):
                tail = container.logs(tail=25).decode(errors="replace")
                raise DeployError(
                    f"container {container.name} stopped (exit code {state.get('ExitCode')}):\n"
                    f"{tail}{_hint(tail)}"
                )
            if state["Status"] == "running" and health in (None, "healthy"):
                pending.remove(container)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise DeployError(f"{names} not healthy after {seconds:.0f}s; see `logs`")
        time.sleep(1)


JOINED_RE = re.compile(r"SuperNode ID: (\d+)")
# What a SuperNode's log says when it cannot join, and what to do about it.
LOG_HINTS = (
    (
        "No SuperNode found with the given public key",
        "the SuperLink does not know this node's key: register it first with "
        "`flwr supernode register KEY.pub <connection>` (compose: TESSERA_SUPERNODE_AUTH "
        "and the register service)",
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        "the SuperLink's certificate does not verify with --ca-cert for the --superlink "
        "name: regenerate it with that name (scripts/gen-certs.sh --names ...)",
    ),
    (
        "Unable to parse the private key file",
        "--auth-key must be an ECDSA key in OpenSSH format (ssh-keygen -t ecdsa -b 384)",
    ),
)


def _hint(log_text: str) -> str:
    """Explain a known failure in a container log, or return ''."""
    for needle, hint in LOG_HINTS:
        if needle in log_text:
            return f"\n=> {hint}"
    return ""


def _wait_joined(supernode: Any, seconds: float) -> str:
    """Wait until the SuperNode has registered with the SuperLink; return its node id."""
    deadline = time.monotonic() + seconds
    while True:
        text = supernode.logs(tail=200).decode(errors="replace")
        match = JOINED_RE.search(text)
        if match:
            return match.group(1)
        supernode.reload()
        if supernode.attrs["State"]["Status"] != "running" or supernode.attrs.get(
            "RestartCount", 0
        ):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    raise DeployError(
        f"{supernode.name} did not join the SuperLink within {seconds:.0f}s (an "
        "unregistered --auth-key, a SuperLink without TLS, or another flwr version?); "
        f"its log:\n{text[-2500:]}{_hint(text)}"
    )


# ----------------------------------------------------------------------- commands
def cmd_deploy(args: argparse.Namespace) -> int:
    """Deploy one node; undo everything on failure."""
    name = check_name(args.name)
    superlink = parse_superlink(args.superlink)
    node_config = with_state_dir(args.node_config)
    state_source, named_volume = state_volume(name, args.state_dir)
    ca_pem: str | None = None
    if not args.insecure:
        if not args.ca_cert:
            raise UsageError("--ca-cert is required (the SuperLink's CA) unless --insecure")
        try:
            ca_pem = Path(args.ca_cert).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--ca-cert {args.ca_cert}: {err}") from None
        if "-----BEGIN CERTIFICATE-----" not in ca_pem:
            raise UsageError(f"--ca-cert {args.ca_cert} is not a PEM certificate")
    key_pem: bytes | None = None
    if args.auth_key:
        try:
            key_pem = Path(args.auth_key).read_bytes()
        except OSError as err:
            raise UsageError(f"--auth-key {args.auth_key}: {err}") from None
        if b"PRIVATE KEY" not in key_pem:
            raise UsageError(f"--auth-key {args.auth_key} is not a private key (PEM/OpenSSH)")
        if args.insecure:
            raise UsageError("--auth-key needs TLS; drop --insecure")

    client = connect(args)
    host = host_info(client)
    plan = plan_images(
        host,
        tag=args.tag,
        flower_image=args.flower_image,
        app_image=args.app_image,
        gpu=args.gpu,
    )
    print(f"host {host.name}: {host.arch}, {host.os}, runtimes {', '.join(host.runtimes)}")
    print(f"images: SuperNode {plan.supernode}, ClientApp {plan.clientapp} ({plan.note})")
    containers, networks = _labelled(client, name)
    if containers or networks:
        raise DeployError(
            f"a node named {name!r} is already on {host.name} "
            f"({', '.join(c.name for c in containers) or 'a network'}); "
            "`remove` it first or choose another --name"
        )
    for ref in dict.fromkeys((plan.supernode, plan.clientapp)):
        ensure_image(client, ref, host, pull=args.pull, build=args.build)

    created: list[Any] = []
    new_volume = None
    try:
        if named_volume:
            try:
                client.volumes.get(state_source)
                print(f"node state: reusing volume {state_source}")
            except Exception:
                new_volume = client.volumes.create(state_source, labels={LABEL: name})
                print(f"node state: new volume {state_source}")
        network = args.network
        if network is None:
            network = f"tessera-{name}"
            client.networks.create(network, driver="bridge", labels={LABEL: name})
        else:
            try:
                client.networks.get(network)
            except Exception:
                raise DeployError(f"--network {network!r} does not exist on {host.name}") from None
        report = preflight(
            client,
            plan.supernode,
            name=name,
            superlink=superlink,
            ca_pem=ca_pem,
            ca_label=args.ca_cert or "",
            network=network,
            dns=args.dns,
            timeout=args.connect_timeout,
        )
        print(
            f"SuperLink {args.superlink} reachable from the device "
            f"({report.get('address')}, {report.get('tls') or 'plaintext'})"
        )
        restart = {"Name": args.restart}
        if args.restart == "on-failure":
            restart["MaximumRetryCount"] = 5
        supernode_name = f"tessera-{name}-supernode"
        env = {
            "TESSERA_TLS": "false" if args.insecure else "true",
            "TESSERA_SUPERNODE_AUTH": "true" if key_pem else "false",
            "TESSERA_SUPERLINK": args.superlink,
            "TESSERA_NODE_CONFIG": node_config,
            "TESSERA_NODE_KEY": "/certs/node.key",
        }
        supernode = client.containers.create(
            plan.supernode,
            command=["supernode"],
            name=supernode_name,
            environment=env,
            labels={LABEL: name, ROLE_LABEL: "supernode"},
            network=network,
            restart_policy=restart,
            init=True,
            dns=list(args.dns) or None,
        )
        created.append(supernode)
        files = []
        if ca_pem:
            files.append(("ca.crt", ca_pem.encode(), 0o644))
        if key_pem:
            files.append(("node.key", key_pem, 0o600))
        if files:
            supernode.put_archive("/certs", _tar(files))
        limits: dict[str, Any] = {}
        if args.cpus:
            limits["nano_cpus"] = int(args.cpus * 1e9)
        if args.memory:
            limits["mem_limit"] = args.memory
        clientapp = client.containers.create(
            plan.clientapp,
            command=["clientapp"],
            name=f"tessera-{name}-clientapp",
            environment={"TESSERA_APPIO": f"{supernode_name}:9094"},
            labels={LABEL: name, ROLE_LABEL: "clientapp"},
            volumes={state_source: {"bind": STATE_MOUNT, "mode": "rw"}},
            network=network,
            restart_policy=restart,
            init=True,
            runtime=plan.runtime,
            dns=list(args.dns) or None,
            **limits,
        )
        created.append(clientapp)
        supernode.start()
        clientapp.start()
        deadline = time.monotonic() + args.wait
        _wait_running(client, created, args.wait)
        node_id = _wait_joined(supernode, max(deadline - time.monotonic(), 5.0))
    except BaseException as err:
        removed = _remove(client, name)
        if new_volume is not None:
            with contextlib.suppress(Exception):
                new_volume.remove(force=True)
                removed.append(f"volume {state_source}")
        if removed:
            print(f"rolled back: removed {', '.join(removed)}", file=sys.stderr)
        if isinstance(err, DeployError):
            raise
        if isinstance(err, Exception):
            raise DeployError(f"deploying {name!r} failed: {err}") from None
        raise
    print(
        f"deployed {name!r} on {host.name}: {supernode_name} -> {args.superlink} "
        f"(joined as SuperNode {node_id}), "
        f"tessera-{name}-clientapp ({plan.clientapp}"
        + (", runtime nvidia" if plan.runtime else "")
        + f"); restart policy {args.restart}"
    )
    return 0


def _rows(client: Any, name: str | None) -> Iterator[dict[str, str]]:
    containers, _ = _labelled(client, name)
    for c in sorted(containers, key=lambda c: c.name):
        state = c.attrs["State"]
        env = dict(e.split("=", 1) for e in c.attrs["Config"].get("Env") or [] if "=" in e)
        yield {
            "node": c.labels.get(LABEL, "?"),
            "role": c.labels.get(ROLE_LABEL, "?"),
            "container": c.name,
            "image": ",".join(c.image.tags) if c.image and c.image.tags else c.attrs["Image"],
            "state": state["Status"],
            "health": (state.get("Health") or {}).get("Status", "-"),
            "restarts": str(c.attrs.get("RestartCount", 0)),
            "started": state.get("StartedAt", "")[:19],
            "node_config": env.get("TESSERA_NODE_CONFIG", ""),
        }


def cmd_status(args: argparse.Namespace) -> int:
    """Print the deployed nodes' containers (all, or one node's)."""
    if args.name:
        check_name(args.name)
    client = connect(args)
    rows = list(_rows(client, args.name))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0 if rows or not args.name else 1
    if not rows:
        print(f"no Tessera node{' named ' + repr(args.name) if args.name else 's'} deployed")
        return 1 if args.name else 0
    cols = ["node", "role", "state", "health", "restarts", "started", "image", "node_config"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (or follow) one node's container logs."""
    check_name(args.name)
    client = connect(args)
    containers, _ = _labelled(client, args.name)
    chosen = [
        c
        for c in containers
        if args.role in ("all", c.labels.get(ROLE_LABEL))
        and c.labels.get(ROLE_LABEL) != "preflight"
    ]
    if not chosen:
        raise DeployError(f"no {args.role} container of node {args.name!r} on this host")
    for c in sorted(chosen, key=lambda c: c.name):
        print(f"===== {c.name} =====", flush=True)
        if args.follow and len(chosen) == 1:
            for chunk in c.logs(stream=True, follow=True, tail=args.tail):
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        else:
            sys.stdout.write(c.logs(tail=args.tail).decode(errors="replace"))
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Stop and remove one node's containers and its network (and state with --purge)."""
    import docker.errors

    name = check_name(args.name)
    client = connect(args)
    removed = _remove(client, name)
    volume, _ = state_volume(name, None)
    if args.purge:
        try:
            client.volumes.get(volume).remove(force=True)
            removed.append(f"volume {volume}")
        except docker.errors.NotFound:
            pass
    if not removed:
        raise DeployError(f"no node named {args.name!r} on this host (see `status`)")
    print(f"removed {', '.join(removed)}")
    if not args.purge:
        print(f"kept the node's state (volume {volume}, if any); `remove --purge` deletes it")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line parser.

    Returns
    -------
    argparse.ArgumentParser
        The parser with the deploy, status, logs and remove commands.
    """
    parser = argparse.ArgumentParser(
        prog="edge_deploy.py",
        description="Deploy Tessera client nodes (SuperNode + ClientApp) to Docker hosts.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--host",
        help="Docker host: ssh://user@host, tcp://host:2376, unix:///path; default: "
        "DOCKER_HOST or the local engine",
    )
    common.add_argument("--tls-ca", help="CA of a tcp:// engine's TLS (or DOCKER_CERT_PATH)")
    common.add_argument("--tls-cert", help="client certificate for a tcp:// engine")
    common.add_argument("--tls-key", help="client key for a tcp:// engine")
    common.add_argument(
        "--no-tls-verify",
        dest="tls_verify",
        action="store_false",
        help="do not verify a tcp:// engine's certificate",
    )
    common.add_argument("--timeout", type=int, default=30, help="engine API timeout, s")
    sub = parser.add_subparsers(dest="command", required=True)

    deploy = sub.add_parser("deploy", parents=[common], help="deploy a node")
    deploy.add_argument("--name", required=True, help="node name, e.g. pi-1")
    deploy.add_argument(
        "--superlink", required=True, help="SuperLink Fleet API as the device dials it, host:port"
    )
    deploy.add_argument("--ca-cert", help="the SuperLink's CA certificate (ca.crt)")
    deploy.add_argument("--insecure", action="store_true", help="plaintext SuperLink (no TLS)")
    deploy.add_argument(
        "--node-config", required=True, help='e.g. "partition-id=0 num-partitions=4"'
    )
    deploy.add_argument(
        "--auth-key",
        help="the node's private key (SuperNode authentication; register "
        "the .pub with `flwr supernode register` first)",
    )
    deploy.add_argument("--tag", default=DEFAULT_TAG, help="tag of the default images")
    deploy.add_argument("--flower-image", help="SuperNode image (default tessera/flower:TAG)")
    deploy.add_argument("--app-image", help="ClientApp image (default by host: cpu or jetson)")
    deploy.add_argument("--gpu", default="auto", choices=["auto", "on", "off"])
    deploy.add_argument(
        "--pull",
        default="missing",
        choices=["missing", "always", "never"],
        help="pull images the host lacks (default), always, or never",
    )
    deploy.add_argument("--build", action="store_true", help="build missing images on the host")
    deploy.add_argument("--network", help="existing Docker network to join (default: a new one)")
    deploy.add_argument("--dns", action="append", default=[], help="DNS server for the node")
    deploy.add_argument("--cpus", type=float, help="CPU limit of the ClientApp container")
    deploy.add_argument("--memory", help="memory limit of the ClientApp container, e.g. 1g")
    deploy.add_argument(
        "--restart", default="unless-stopped", choices=["unless-stopped", "always", "on-failure"]
    )
    deploy.add_argument("--connect-timeout", type=float, default=5.0)
    deploy.add_argument("--wait", type=float, default=90.0, help="seconds to wait for health")
    deploy.add_argument(
        "--state-dir",
        help="host folder for the node's state (default: the volume tessera-NAME-state)",
    )
    deploy.set_defaults(func=cmd_deploy)

    status = sub.add_parser("status", parents=[common], help="list deployed nodes")
    status.add_argument("--name", help="one node")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    logs = sub.add_parser("logs", parents=[common], help="show a node's logs")
    logs.add_argument("--name", required=True)
    logs.add_argument("--role", default="all", choices=["all", "supernode", "clientapp"])
    logs.add_argument("--tail", type=int, default=200)
    logs.add_argument("--follow", "-f", action="store_true")
    logs.set_defaults(func=cmd_logs)

    remove = sub.add_parser("remove", parents=[common], help="remove a node")
    remove.add_argument("--name", required=True)
    remove.add_argument("--purge", action="store_true", help="also delete the node's state volume")
    remove.set_defaults(func=cmd_remove)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv : Sequence of str or None
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as err:
        print(f"edge_deploy: error: {err}", file=sys.stderr)
        return 2
    except DeployError as err:
        print(f"edge_deploy: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edge_deploy: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
