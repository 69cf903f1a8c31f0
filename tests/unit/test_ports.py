"""storage/ports.py: ports a server can bind, outside the kernel's ephemeral range."""
import socket

import pytest

from storage import ports


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    eph = ports.ephemeral_range()
    got = ports.free_ports(50, "")
    assert len(set(got)) == 50
    for p in got:
        assert p in ports.FREE_PORTS and p not in eph
        with socket.socket() as s:
            s.bind(("", p))


def test_a_port_someone_holds_or_already_picked_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        a, b = ports.free_ports(2)
        picks = iter([taken, a, a, b])
        monkeypatch.setattr(ports.random, "choice", lambda pool: next(picks))
        assert ports.free_ports(2) == [a, b]


def test_no_free_port_is_an_error_that_says_where_it_looked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        monkeypatch.setattr(ports, "FREE_PORTS", range(port, port + 1))
        monkeypatch.setattr(ports, "ephemeral_range", lambda: range(0))
        with pytest.raises(RuntimeError, match=f"no 1 free ports in {port}-{port}"):
            ports.free_port()
