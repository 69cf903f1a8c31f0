"""NVIDIA Dynamo's KV indexer as a consumer of strata's KV-event wire, for tests.

The point is that Dynamo reads the workers' bytes unchanged: this harness decodes nothing. It registers each worker's PUB endpoint (and replay endpoint) with a Dynamo ``SelectionService``,
the same embedding Ray Serve LLM's ``KVAwareRouter`` uses (ray/llm/_internal/serve/routing_policies/
kv_aware/kv_token_tracker.py), and Dynamo's own listener subscribes, decodes (its own vLLM wire decoder:
tagged maps and positional arrays), recomputes its own block hashes from ``token_ids`` and indexes.
Overlaps are then asked by token ids, as Dynamo's router asks them.

``dynamo._core.RadixTree`` is not used: its ``apply_event`` takes Dynamo's internal JSON
``KvCacheEvent`` (already converted, local hashes included), not wire bytes, so feeding it would put a
decoder of ours between strata and Dynamo.

What the pinned Dynamo (ai-dynamo-runtime 1.6.1) does with the wire, as tests/interop/test_dynamo_index.py
proves it:
- tiers come from ``medium``: GPU/DEVICE -> device; CPU, CPU_PINNED, CPU_TIER1 -> host; DISK, NVME,
  CPU_TIER2 -> disk; no medium or an unknown one -> device (GPU, CPU, CPU_PINNED, DISK and none are
  proven here, the rest read from Dynamo's source). "CPU" is the host tier: an L1 on a CPU device must be
  published as GPU to count as device.
- a BlockStored whose parent block Dynamo does not know is dropped whole; a host block may hang off a
  parent held on device only (as a write-back eviction makes it), a device block whose parent is on the
  host only is dropped. A match walks blocks while each is on some tier and stops at the first that is on
  none.
- a BlockStored whose ``block_size`` differs from the indexer's is dropped whole.
- only the main attention group is indexed: ``kv_cache_spec_kind`` decides when present (full_attention,
  mla_attention, sink_full_attention kept), else ``group_idx`` (0 kept). Sliding-window events, stored or
  removed, are ignored, so a tombstoned window is invisible to Dynamo.
- AllBlocksCleared clears the worker on every tier.
- seq: the first batch it expects is seq 0; on a gap (the first batch included) it asks the replay
  endpoint from the missing seq, then goes on. History published before it connected and never followed
  by a later batch is not asked for. A batch at or below the last seq it saw is dropped unread: a
  restarted publisher whose seq starts again from 0 is ignored (its AllBlocksCleared included) until its
  seq passes the old one, or until the worker is registered again (``remove_worker`` + ``add_worker``:
  the old incarnation's blocks are forgotten and, with a replay endpoint, the new one is replayed from 0).
- the topic is not read (Dynamo subscribes to every topic).
- overlaps are prefix lengths in blocks, cumulative down the tiers: ``host`` counts the device prefix plus
  the host blocks that extend it, ``disk`` the same one tier further.

Nothing here talks to anything but the endpoints it is given (127.0.0.1 in tests).

Install (ai-dynamo-runtime pins pydantic<=2.13.5, below the suite's, and does not need it for this):
``pip install --no-deps --target <dir> ai-dynamo-runtime==1.6.1`` and put ``<dir>`` on PYTHONPATH; or
``pip install -e .[interop]`` in a venv of its own.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Iterable, Mapping, NamedTuple, Sequence

try:
    from dynamo.llm import SelectionService
    SKIP_REASON = ""
except ImportError as e:  # the optional extra is not installed: tests that need it skip with this
    SelectionService = None
    SKIP_REASON = (f"Dynamo is not importable ({e}); install ai-dynamo-runtime (pyproject extra 'interop', "
                   "or pip install --no-deps --target DIR ai-dynamo-runtime and DIR on PYTHONPATH)")

AVAILABLE = SelectionService is not None

# Every registered worker belongs to one Dynamo model partition; its name means nothing to the wire.
_MODEL = "strata"
# One call into Dynamo is in-process work; far past this, the service is wedged.
_CALL_TIMEOUT_S = 30.0


class WorkerStream(NamedTuple):
    """Where one worker publishes: its id as Dynamo will report it, its PUB endpoint, and its replay
    (ROUTER) endpoint if it has one (without it Dynamo cannot recover a gap)."""
    worker_id: int
    endpoint: str
    replay_endpoint: str | None = None


class TierOverlap(NamedTuple):
    """Dynamo's overlap of a prompt with one worker, in blocks, cumulative down the tiers:
    device <= host <= disk (host = the device prefix extended by host blocks, disk = extended again).

    Against strata's router (actors/routing.Overlap.by_tier, full component): L1 == device and
    L2 == host - device, as long as each worker's L1 pages are a prefix of its cached pages (strata's
    L1 evicts leaves first). L3 is not a worker's: the storage actor publishes it as a stream of its own,
    which Dynamo sees as one more worker, so a strata worker has no disk blocks and ``disk == host``."""
    device: int
    host: int
    disk: int


NO_OVERLAP = TierOverlap(0, 0, 0)


class DynamoIndex:
    """Dynamo's selection service subscribed to a set of workers' KV-event streams.

    Dynamo's asynchronous API runs on an event loop of this object's own thread, so tests call it
    synchronously. Indexing is asynchronous to publishing: ask with ``wait_for`` when an answer is
    expected, or after publishing has quiesced."""

    def __init__(self, streams: Iterable[WorkerStream], block_size: int, indexer_threads: int = 1):
        if not AVAILABLE:
            raise RuntimeError(SKIP_REASON)
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._workers: dict[int, WorkerStream] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dynamo-index", daemon=True)
        self._thread.start()
        # The service spawns its listeners on the runtime of the loop that creates it: create it there.
        self._svc = self._call(SelectionService, indexer_threads=indexer_threads)
        try:
            for stream in streams:
                self.add_worker(stream)
        except BaseException:
            self.close()
            raise

    def _call(self, fn, *args, **kwargs):
        """``fn(*args)`` run on this object's loop, awaited when it answers an awaitable: Dynamo's
        asynchronous methods make their future at call time, on the running loop, so they are called
        there, not here."""
        async def run():
            out = fn(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(_CALL_TIMEOUT_S)

    @property
    def worker_ids(self) -> list[int]:
        return sorted(self._workers)

    def add_worker(self, stream: WorkerStream) -> None:
        """Subscribe Dynamo to one more worker (a known id is re-registered: its index is kept)."""
        record = {
            "worker_id": stream.worker_id,
            "model_name": _MODEL,
            # Required by the service though unused without Dynamo's own runtime (as in Ray Serve LLM).
            "endpoint": f"strata://{stream.worker_id}",
            "block_size": self.block_size,
            "data_parallel_start_rank": 0,
            "data_parallel_size": 1,
            "kv_events_endpoints": {0: stream.endpoint},
            "replay_endpoint": stream.replay_endpoint,
        }
        answer = self._call(self._svc.upsert_worker, record)
        if answer.get("lifecycle") != "schedulable":
            raise RuntimeError(f"Dynamo did not accept worker {stream.worker_id}: {answer}")
        self._workers[stream.worker_id] = stream

    def remove_worker(self, worker_id: int) -> None:
        """Unsubscribe a worker; Dynamo forgets its blocks."""
        self._call(self._svc.delete_worker, worker_id)
        del self._workers[worker_id]

    def overlaps(self, token_ids: Sequence[int]) -> dict[int, TierOverlap]:
        """Per registered worker, Dynamo's overlap of ``token_ids`` (one prompt, int token ids) with what
        that worker has published; a worker Dynamo leaves out of its answer overlaps by nothing."""
        answer = self._call(self._svc.overlap_scores, {"model_name": _MODEL, "token_ids": list(token_ids)})
        if answer["block_size"] != self.block_size:
            raise RuntimeError(f"Dynamo answered for block size {answer['block_size']}, not {self.block_size}")
        out = {w: NO_OVERLAP for w in self._workers}
        for rec in answer["workers"]:
            out[rec["worker_id"]] = TierOverlap(rec["device_blocks"], rec["host_pinned_blocks"],
                                                rec["disk_blocks"])
        return out

    def device_overlaps(self, token_ids: Sequence[int]) -> dict[int, int]:
        """Per worker, the device-tier (L1) overlap only, in blocks."""
        return {w: o.device for w, o in self.overlaps(token_ids).items()}

    def wait_for(self, token_ids: Sequence[int], expected: Mapping[int, TierOverlap | int],
                 timeout_s: float = 5.0, poll_s: float = 0.02) -> dict[int, TierOverlap | int]:
        """Poll until Dynamo's overlaps of ``token_ids`` equal ``expected`` (values TierOverlap, or ints
        compared to the device tier) or ``timeout_s`` passes; -> the last answer, in the form of
        ``expected``, for the caller to assert on. Workers absent from ``expected`` are not compared."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.overlaps(token_ids)
            seen = {w: (got.get(w, NO_OVERLAP) if isinstance(v, TierOverlap) else got.get(w, NO_OVERLAP).device)
                    for w, v in expected.items()}
            if seen == dict(expected) or time.monotonic() >= deadline:
                return seen
            time.sleep(poll_s)

    def close(self) -> None:
        """Stop Dynamo's listeners and this object's loop; idempotent."""
        if self._loop.is_closed():
            return
        svc, self._svc = getattr(self, "_svc", None), None
        if svc is not None:
            self._call(svc.shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "DynamoIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
