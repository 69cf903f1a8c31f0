"""Lease quarantine (storage/transfer/base.py, sends.py): a one-sided send that may still write keeps
its destination pages out of the pool until its sender says it is over or is gone."""
import pytest

from storage.pools import PageAllocator
from storage.transfer.base import LeaseInfo, LeaseTable, TransferError
from storage.transfer.sends import SendRecord


def _table():
    return LeaseTable({"full": PageAllocator(8, "full"), "swa": PageAllocator(4, "swa")})


def test_an_expired_one_sided_lease_is_quarantined_until_its_send_ends():
    t = _table()
    lease = t.reserve("a", {"full": 3, "swa": 2}, 0.0, 1.0, LeaseInfo(40, one_sided=True))
    assert t.expire(2.0) == [lease]
    t.check_integrity()
    # the pages are neither leased nor free: a late write lands where nobody reads
    assert t.allocators["full"].num_free == 5 and t.num_pages("full") == 3
    taken = t.allocators["full"].alloc(5)
    assert not set(taken) & set(lease.pages["full"])
    t.allocators["full"].free(taken)
    assert t.send_ended("a") and not t.release("a")
    t.check_integrity()
    assert t.allocators["full"].num_free == 8 and t.stats().in_quarantine == 0
    assert t.counts["quarantined"] == 1 and t.counts["released"] == 1


def test_a_send_that_ended_first_lets_cancel_free_at_once_and_two_sided_never_waits():
    t = _table()
    t.reserve("a", {"full": 2, "swa": 1}, 0.0, 1.0, LeaseInfo(40, one_sided=True))
    assert not t.send_ended("a")          # live: only marked
    assert t.cancel("a") and t.allocators["full"].num_free == 8
    t.reserve("b", {"full": 2, "swa": 1}, 0.0, 1.0, LeaseInfo(40, one_sided=False))
    t.cancel("b")
    assert t.allocators["full"].num_free == 8 and t.counts["quarantined"] == 0
    t.reserve("c", {"full": 2, "swa": 1}, 0.0, 1.0, LeaseInfo(40, one_sided=True))
    t.cancel("c")
    assert t.allocators["full"].num_free == 6 and t.release("c") and t.allocators["full"].num_free == 8


def test_a_committed_lease_is_never_quarantined():
    t = _table()
    t.reserve("a", {"full": 2, "swa": 1}, 0.0, 1.0, LeaseInfo(40, one_sided=True))
    lease = t.commit("a", 0.5)
    assert t.stats().in_quarantine == 0 and len(lease.pages["full"]) == 2


def test_send_record_refuses_a_lease_it_said_no_for():
    s = SendRecord()
    assert not s.pending("x", set())      # never seen: refused from now on
    with pytest.raises(TransferError, match="gave it up"):
        s.begin("x")
    s.begin("y", notify="dec")
    assert s.pending("y", set())
    assert s.end("y") == "dec" and not s.pending("y", set())
    assert s.pending("z", {"z"})          # in flight in the backend (could not be aborted)
