"""Binding a ZMQ socket where a peer on another node can reach it: on the node's address, on a port the
kernel picks (so two workers, routers or clusters on one machine never collide), never blocking a send
(no high-water mark) and never lingering on close. The token channel's and the route channel's servers
bind so."""
from __future__ import annotations

import zmq

QUIET = ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0))


def bind_random(ctx: zmq.Context, kind: int, host: str, extra: tuple = ()) -> tuple[zmq.Socket, str]:
    """A new ``kind`` socket of ``ctx`` bound on ``host`` at a free port, with QUIET and ``extra`` options;
    (socket, its ``tcp://host:port`` endpoint). The socket is closed again when the bind fails."""
    sock = ctx.socket(kind)
    try:
        for opt, v in (*QUIET, *extra):
            sock.setsockopt(opt, v)
        port = sock.bind_to_random_port(f"tcp://{host}")
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, f"tcp://{host}:{port}"


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close ``sock`` and the monitor socket ``get_monitor_socket`` gave for it (its monitor stopped first:
    a context cannot end while either is open)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:   # already closed or never monitored
        pass
    monitor.close(linger=0)
    sock.close(linger=0)
