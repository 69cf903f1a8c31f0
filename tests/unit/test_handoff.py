"""The P/D handoff coordinator (actors/handoff.py) over an in-memory Workers protocol: the order of the
calls, the cached counts on the items, and the lease cancelled on every path that does not commit it
(prefill failure, an answer done at its first token, a client that leaves)."""
import asyncio

import pytest

from actors.handoff import KVHandoff
from engine.async_engine import StreamItem
from engine.sampling import SamplingParams
from storage.transfer import Destination
from storage.transfer.base import Receipt


# In process the Receipt itself is handed on (over Ray, a reference to it): passed as is, never read.
RECEIPT = Receipt(prompt_len=3, first_token=7, swa_first_page=0, swa_valid_from=0, sender="prefill-0")


class Recorder:
    def __init__(self, first_reason="prefill", fail_prefill=False, n=3):
        self.calls, self.first_reason, self.fail_prefill, self.n = [], first_reason, fail_prefill, n

    async def reserve(self, decode, prompt_len, prefill):
        self.calls.append(("reserve", decode, prompt_len, prefill))
        return Destination("L1", "ray_object", prompt_len, 16, [0], [], 0, 30.0, decode)

    async def prefill_to(self, prefill, ids, params, res):
        self.calls.append(("prefill_to", prefill, res.lease_id, res.decode))
        if self.fail_prefill:
            raise RuntimeError("prefill died")
        return StreamItem("r", [7], finished=True, finish_reason=self.first_reason, cached_tokens=16,
                          cached_tokens_by_tier={"L1": 16, "L2": 0, "L3": 0}), RECEIPT

    async def decode_leased(self, decode, ids, lease_id, receipt, params):
        self.calls.append(("decode_leased", decode, lease_id, receipt))
        for i in range(self.n):
            yield StreamItem("r", [8 + i], finished=i == self.n - 1, finish_reason="length" if i == self.n - 1 else None)

    def cancel(self, decode, lease_id):
        self.calls.append(("cancel", decode, lease_id))

    async def generate(self, worker, ids, params):
        self.calls.append(("generate", worker))
        yield StreamItem("r", [1], finished=True, finish_reason="length")


async def _all(agen):
    return [x async for x in agen]


SP = SamplingParams(max_new_tokens=4)


def test_a_handoff_reserves_sends_commits_and_never_cancels_a_committed_lease():
    w = Recorder()
    items = asyncio.run(_all(KVHandoff(w).run([1, 2, 3], SP, "prefill-0", "decode-0")))
    assert [c[0] for c in w.calls] == ["reserve", "prefill_to", "decode_leased"]
    assert w.calls[2][3] is RECEIPT and [i.token_ids for i in items] == [[7], [8], [9], [10]]
    assert not items[0].finished and items[-1].finished and items[-1].cached_tokens == 16
    assert items[-1].cached_tokens_by_tier == {"L1": 16, "L2": 0, "L3": 0}


@pytest.mark.parametrize("case", ["prefill fails", "done at first token", "client leaves"])
def test_every_path_that_does_not_commit_cancels_the_lease(case):
    w = Recorder(fail_prefill=case == "prefill fails", first_reason="stop" if case == "done at first token" else "prefill")

    async def go():
        gen = KVHandoff(w).run([1, 2, 3], SP, "prefill-0", "decode-0")
        if case == "client leaves":
            await gen.__anext__()
            await gen.aclose()
            return
        return await _all(gen)
    if case == "prefill fails":
        with pytest.raises(RuntimeError):
            asyncio.run(go())
    else:
        asyncio.run(go())
    assert w.calls[-1] == ("cancel", "decode-0", "L1") and "decode_leased" not in [c[0] for c in w.calls]


def test_a_colocated_route_generates_on_one_worker():
    w = Recorder()
    items = asyncio.run(_all(KVHandoff(w).run([1], SP, "colocated-0", None)))
    assert w.calls == [("generate", "colocated-0")] and [i.token_ids for i in items] == [[1]]
