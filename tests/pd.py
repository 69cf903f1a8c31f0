"""Prefill on one engine, decode on another, in one process through the very verbs a cluster uses (no
Ray): the decode engine reserves a lease (``Engine.reserve_kv``), the prefill engine's prefill-only
request exports its payload, the transfer backend's ``send`` packs it into a ``Receipt`` for the lease's
``Destination``, and the decode engine admits the request with the backend's ``fill``
(``Engine.add_leased``). The ray_object backend by default: its object-store half is the only part left
out. Imports neither Ray nor anything the GPU image lacks (bench/gpu_check uses it too)."""
from __future__ import annotations

import itertools
from typing import Sequence

from engine import Engine, SamplingParams
from storage.transfer.payload import KVPayload
from storage.transfer.base import Destination, TransferBackend
from storage.transfer.ray_object import RayObjectBackend

_lease_ids = itertools.count()


def reserve(dec: Engine, prompt_len: int, backend: TransferBackend, now: float = 0.0,
            ttl: float = 60.0) -> Destination:
    """The decode side's lease for a prompt of ``prompt_len`` tokens, as a worker hands it out."""
    pages = dec.reserve_kv(f"pd-{next(_lease_ids)}", prompt_len, now, ttl, backend.one_sided)
    return Destination.of(pages, backend, dec.cfg.page_size, ttl, "decode")


def prefill(pre: Engine, prompts: Sequence[list[int]], params: SamplingParams) -> list[KVPayload]:
    """Run ``prompts`` as prefill-only requests in one batch; -> their payloads (the requests are gone)."""
    rids = [pre.add_request(p, params, prefill_only=True) for p in prompts]
    while pre.has_unfinished():
        pre.step()
    payloads = [pre.requests[r].kv_payload for r in rids]
    for r in rids:
        pre.pop_finished(r)
    return payloads


def send_and_admit(dec: Engine, prompt: list[int], dest: Destination, payload: KVPayload,
                   params: SamplingParams, backend: TransferBackend, now: float = 0.0) -> str:
    """Send ``payload`` into ``dest`` and admit ``prompt`` over it; -> the decode engine's rid. A failed
    send cancels the lease (as the handoff does); a failed admission frees it by itself."""
    try:
        rec = backend.send(payload, dest, dest.ttl)
    except BaseException:
        dec.receiver.cancel(dest.lease_id)
        raise
    return dec.add_leased(prompt, dest.lease_id, rec._replace(sender="prefill"), params, backend, now=now)


def handoff(pre: Engine, dec: Engine, prompts: Sequence[list[int]], params: SamplingParams,
            backend: TransferBackend | None = None, now: float = 0.0) -> list[str]:
    """Each prompt the way the cluster serves it (leases first, then prefill, send, admit); -> the decode
    engine's rids, to step ``dec`` to completion."""
    backend = backend or RayObjectBackend()
    dests = [reserve(dec, len(p), backend, now) for p in prompts]
    payloads = prefill(pre, prompts, params)
    return [send_and_admit(dec, p, d, kv, params, backend, now) for p, d, kv in zip(prompts, dests, payloads)]
