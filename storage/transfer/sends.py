"""The prefill side's record of its one-sided sends, for the decode side's quarantine (base.py).

A decode worker holding a quarantined lease asks the sender whether a send into it may still write
(``pending``). The answer must stay true: a "no" for a send that has not started yet would let the
decode side reuse the pages and the send start later. So a "no" also *refuses* the lease: a send that
``begin``s after it is refused raises instead of writing. Both calls run on the worker's event loop, so
they never interleave. Plain (no Ray, no clock): whom to tell is a worker id; the worker shell holds the handles."""
from __future__ import annotations

from collections import OrderedDict

from storage.transfer.base import TransferError

MAX_REFUSED = 4096     # refused ids remembered (a refused lease is never sent to later than that)


class SendRecord:
    def __init__(self) -> None:
        self.sending: dict[str, str] = {}              # lease id -> the decode worker to tell when it ends
        self.refused: OrderedDict[str, None] = OrderedDict()

    def begin(self, lease_id: str, notify: str = "") -> None:
        """Before any work for a send into ``lease_id``; TransferError if the decode side gave it up."""
        if lease_id in self.refused:
            raise TransferError(f"lease {lease_id}: the decode side gave it up before the send began")
        self.sending[lease_id] = notify

    def end(self, lease_id: str) -> str | None:
        """The send is over (nothing more can be written); returns whom to tell (its id; "" for nobody),
        None when no such send was recorded."""
        return self.sending.pop(lease_id, None)

    def pending(self, lease_id: str, in_flight: set[str]) -> bool:
        """Whether a send into ``lease_id`` may still write; if not, it never will (refused)."""
        if lease_id in self.sending or lease_id in in_flight:
            return True
        self.refused[lease_id] = None
        while len(self.refused) > MAX_REFUSED:
            self.refused.popitem(last=False)
        return False
