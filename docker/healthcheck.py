#!/usr/bin/env python3
"""Docker HEALTHCHECK of Tessera's images: check that the component's ports accept.

The entry point writes the loopback addresses to probe to ``/tmp/tessera-health``
(first the component's gRPC health server, then its API ports) just before it starts
the component. No file means a one-shot role (init, register, run) or a command
that is not a Flower component: healthy. A plain TCP connect keeps the check cheap
(no gRPC import every few seconds on a small device).
"""

import socket
import sys
from pathlib import Path

HEALTH_FILE = Path("/tmp/tessera-health")


def main() -> int:
    """Return 0 when every listed address accepts a TCP connection, else 1."""
    try:
        addresses = HEALTH_FILE.read_text().split()
    except FileNotFoundError:
        return 0
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except OSError as err:
            print(f"{address}: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
