"""Free loopback ports for the tests that start servers (Ray heads, an MLflow server)."""

import socket


def free_ports(n: int) -> list[int]:
    """n distinct ports free now: all n sockets are bound at once, so no two of them can be the same port (one
    call per port could return a port twice: Ray refused to start when its dashboard and client server got one)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
