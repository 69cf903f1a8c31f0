"""Small helpers the test tiers share."""
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
