"""This process's node address and a free TCP port (rendezvous of a worker group, refit's
broadcast groups)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOW_PORT = 10_000


def node_ip() -> str:
    """The Ray node's IP address of this process."""
    import ray

    return ray.util.get_node_ip_address()


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for bind(0) and outgoing connections (Linux; 32768-60999
    elsewhere)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port that was free a moment ago, chosen at random below the kernel's ephemeral range.

    The port is bound and closed here and bound again later by the rendezvous, so a port from
    bind(0) can be taken in between by any outgoing connection of this machine (Ray and gRPC make
    many): a run's worker then fails with EADDRINUSE. Ports below the ephemeral range are handed
    out by nobody, so only another explicit choice can collide, one in ~20,000 per pair."""
    low, _ = _ephemeral_range()
    high = max(low - 1, _LOW_PORT + 1)
    for _attempt in range(100):
        port = random.randint(_LOW_PORT, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: the kernel's
        sock.bind(("", 0))
        return sock.getsockname()[1]
