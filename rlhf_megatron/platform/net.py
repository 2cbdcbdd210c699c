"""This process's node address and a free TCP port (rendezvous of a worker group, refit's
broadcast groups)."""

from __future__ import annotations

import socket


def node_ip() -> str:
    """The Ray node's IP address of this process."""
    import ray

    return ray.util.get_node_ip_address()


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
