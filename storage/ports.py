"""TCP ports for a server a process is about to start (a ``mooncake_master``, the NIXL slab server,
HAProxy's side ports, a test's or a bench's HTTP front). Stdlib only: cluster/front.py uses it before Ray is
imported.

Not the kernel's choice (``bind(("", 0))``): that port lies in the ephemeral range, where the kernel also
picks the local port of every outgoing connection, so any ``connect()`` on the machine can take it before
the server binds it (CI saw HAProxy's stats port taken that way). The ports here lie below that range,
above Ray's worker ports (10002-19999) and clear of Serve's direct-ingress ranges (30000-31000, 40000-), so
only a process that binds a port on purpose can take one first."""
from __future__ import annotations

import random
import socket

FREE_PORTS = range(20000, 30000)


def ephemeral_range() -> range:
    """The kernel's ephemeral ports (Linux's ip_local_port_range; its default where that cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports of ``FREE_PORTS`` (those outside the ephemeral range, where a machine's range
    reaches into it) that ``host`` can bind right now (``""``: every interface)."""
    eph = ephemeral_range()
    pool = [p for p in FREE_PORTS if p not in eph] or list(FREE_PORTS)
    ports: list[int] = []
    for _ in range(200 + 4 * n):
        port = random.choice(pool)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} on {host or '*'!r}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port of ``free_ports``."""
    return free_ports(1, host)[0]
