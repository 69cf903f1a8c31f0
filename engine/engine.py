"""The offline engine of one worker: ``Engine.from_pretrained(...)``, ``generate``, and the step-level
API (``add_request`` / ``step`` / ``abort``) the Ray workers drive."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from engine.config import EngineConfig, model_id
from engine.eplb import ExpertLoad, PlacementApplied
from engine.model.checkpoint import resolve_model_path
from engine.model.loader import load_config, load_model
from engine.model.moe_dispatch import select_dispatch
from engine.model import moe_slots
from engine.model.tokenizer import TextTokenizer
from engine.request import Request, Status
from engine.runner import ModelRunner
from engine.grammar import GrammarTokenizer
from engine.sampler import make_generator, sample, token_logprobs
from engine.sampling import SamplingParams, TokenLogprob
from engine.stopping import row_state, stop_reason
from engine.scheduler import Scheduler, SchedulerHooks
from engine.kv_manager import KVManager
from engine.disagg import export_kv
from engine.pd import KVReceiver
from engine.prefix import PrefixCacheHooks
from storage.hicache import HiCache, NoCache
from storage.pools import COMPONENTS, KVPools
from storage.geometry import KVGeometry
from storage.transfer.base import LeasedPages, Receipt, TransferBackend

Prompt = Union[str, Sequence[int]]


def req_top(owners: list) -> int:
    return max(req.params.top_logprobs for req, _ in owners)


@dataclass
class GenerationOutput:
    rid: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    logits: list[torch.Tensor] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    matched_stop: int | str | None = None


@dataclass
class StepOutput:
    """What one step produced for one request (for streaming). ``prompt_logprobs``: the prompt-token
    logprobs computed since the last output (one per position from logprob_start_len on, None for
    position 0), on the outputs of a request that asked for them."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    matched_stop: int | str | None = None


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.torch_threads:
            # Process-wide: on a small shared box, spinning intra-op threads of several processes
            # (Ray actors, the copier) slow every one of them down by an order of magnitude.
            torch.set_num_threads(cfg.torch_threads)
        self.device = cfg.torch_device
        path = resolve_model_path(cfg.model)
        self.model_path = path
        if cfg.dtype == "auto":
            cfg = self.cfg = cfg.resolved(load_config(path).torch_dtype)
        self.model_config, self.model = load_model(path, cfg.torch_dtype, self.device)
        mc = self.model_config
        self.moe_layers = self.model.moe_layers
        if cfg.eplb is not None and not self.moe_layers:
            raise ValueError(f"eplb: {mc.architecture} at {path} has no MoE layers; set eplb to null")
        if cfg.eplb is not None:
            moe_slots.enable_slots(self.moe_layers, cfg.eplb.num_ranks, cfg.eplb.num_redundant_experts,
                                   select_dispatch(cfg.eplb.dispatch, local_ranks=cfg.eplb.num_ranks))
        try:
            self.tokenizer: TextTokenizer | None = TextTokenizer(path)
        except ValueError:
            self.tokenizer = None
        self.pools = KVPools(cfg.pool, mc.layer_types, mc.num_key_value_heads, mc.head_dim,
                             cfg.torch_dtype, self.device, poison=cfg.poison_kv)
        self.geometry = KVGeometry.from_layers(mc.layer_types, mc.sliding_window, cfg.page_size)
        self.window = self.geometry.window
        need = self.geometry.swa_pages_bound
        if self.pools.swa.num_pages < need:
            raise ValueError(f"swa_full_ratio: the SWA pool ({self.pools.swa.num_pages} pages) cannot hold one "
                             f"window ({need} pages of {cfg.page_size})")
        self._now = 0.0
        # Decided here once: past construction the engine calls its cache (and hooks) without asking
        # whether there is one (NoCache keeps nothing; SchedulerHooks are the scheduler's "no cache").
        self.cache: HiCache | NoCache = HiCache(self.pools, self.geometry, cfg.hicache, model_id=self.model_id(),
                                                eviction=cfg.prefix_eviction) \
            if cfg.enable_prefix_cache else NoCache()
        # The one owner of every request's L1 pages (the scheduler only decides).
        self.kv = KVManager(self.geometry, self.pools, self.cache, lambda: self._now, cfg.swa_checkpoint_interval)
        self.hooks: SchedulerHooks = PrefixCacheHooks(self.cache, self.kv, lambda: self._now) \
            if cfg.enable_prefix_cache else SchedulerHooks()
        self.scheduler = Scheduler(self.kv, cfg.max_batch_tokens, cfg.max_running_requests,
                                   cfg.effective_chunk_size, hooks=self.hooks)
        self.runner = ModelRunner(self.model, self.pools, self.device)
        self.requests: dict[str, Request] = {}
        # The decode side of P/D: pages leased for KV transfers in flight, until they are a request's.
        self.receiver = KVReceiver(self.kv, mc.vocab_size)
        self._arrival = itertools.count()
        self._rid = itertools.count()
        self._rng = torch.Generator().manual_seed(cfg.seed)
        self.eos_ids = frozenset(mc.eos_token_id)
        self._grammar_tok: GrammarTokenizer | None = None   # built on the first structured-output request
        self.max_context = mc.max_position_embeddings
        self.counters = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}

    def model_id(self) -> str:
        """Everything that changes a KV page's bytes, for keys shared across workers (L3)."""
        return model_id(self.model_path, self.model_config, self.cfg)

    @classmethod
    def from_pretrained(cls, model: str = "strata-tiny", **kwargs) -> "Engine":
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(kwargs) - fields
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        return cls(EngineConfig(model=str(model), **kwargs))

    # ---- requests ----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a tokenizer.json in the checkpoint")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        # Ids as every caller on the serving path sends them (plain ints): one type check per id, not the
        # conversion and the check below (~4 against ~16 ms for a 128k-token prompt). bool is not int here.
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return list(prompt)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError("prompt: must be a string or a list of token ids") from None
        if any(isinstance(t, bool) or not float(t).is_integer() for t in prompt):
            raise ValueError("prompt: token ids must be integers")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, rid: str | None = None,
                    prefill_only: bool = False) -> str:
        """Queue a request. ``prefill_only``: stop after the first token and keep the prompt's KV as
        ``kv_payload`` for a decode engine (finish_reason "prefill" unless the first token ends it).
        ``params.message_boundaries``: where the prompt's messages end; the cache keeps the sliding
        window before each, for prompts branching off there."""
        req = self._new_request(prompt, params, rid)
        req.prefill_only = prefill_only
        self.requests[req.rid] = req
        if req.params.max_new_tokens == 0:
            self._finish(req, "length")
        else:
            self.scheduler.add(req)
        return req.rid

    def reserve_kv(self, lease_id: str, prompt_len: int, now: float, ttl: float, one_sided: bool = False,
                   sender: str = "") -> LeasedPages:
        """Reserve the pages a transferred prompt of ``prompt_len`` tokens will occupy (full: every page;
        SWA: the last window), under a lease that ``now + ttl`` ends (engine/pd.py). MemoryError when
        the batch is full or the pages cannot be had (nothing is held then); TransferError when the id was
        cancelled before it came. ``one_sided``: the sender writes in place (a lease ending before its send
        is quarantined); ``sender``: its worker id."""
        if not isinstance(prompt_len, int) or not 0 < prompt_len < self.max_context:
            raise ValueError(f"prompt_len: must be in [1, {self.max_context}), got {prompt_len!r}")
        if len(self.scheduler.running) + self.receiver.live >= self.cfg.max_running_requests:
            raise MemoryError("decode: running batch is full")
        return self.receiver.reserve(lease_id, prompt_len, now, ttl, one_sided, sender)

    def add_leased(self, prompt: Prompt, lease_id: str, rec: Receipt | None, params: SamplingParams | None,
                   backend: TransferBackend, rid: str | None = None, now: float = 0.0) -> str:
        """Admit a request straight into decode from the pages of ``lease_id``, which ``backend`` fills
        with the KV the sender's receipt ``rec`` stands for (engine/pd.py). Raises TransferError when the
        lease is gone or nothing was sent, ValueError on a bad request or receipt; on any error the
        lease's pages are freed."""
        try:
            req = self._new_request(prompt, params, rid)
        except BaseException:
            self.receiver.cancel(lease_id)
            raise
        self.receiver.admit(req, lease_id, rec, now, backend)
        self.requests[req.rid] = req
        self.scheduler.running.append(req)
        reason = self._stop_reason(req, rec.first_token)
        if reason is not None:
            self._finish(req, reason)
        else:
            # The prompt is whole, as after a local prefill's first token: cache it now, so that its pages
            # are one node of the tree and the offload at finish can skip them (Request.offloaded_pages).
            self.kv.commit(req)
        return req.rid

    def _new_request(self, prompt: Prompt, params: SamplingParams | None, rid: str | None) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in the context of {self.max_context}")
        longest = min(len(ids) + params.max_new_tokens, self.max_context)
        pages = -(-longest // self.cfg.page_size)
        if pages > self.pools.full.num_pages:
            raise ValueError(f"prompt: {len(ids)} + max_new_tokens {params.max_new_tokens} tokens need {pages} "
                             f"pages, the KV pool has {self.pools.full.num_pages}")
        rid = rid if rid is not None else f"req-{next(self._rid)}"
        if rid in self.requests:
            raise ValueError(f"rid: {rid!r} is already in use")
        self._check_params(params, len(ids))
        req = Request(rid, ids, params, arrival=next(self._arrival), boundaries=params.message_boundaries)
        if not params.greedy:
            req.generator = make_generator(params.seed, self._rng)
        if params.grammar is not None:
            req.matcher = self.grammar_tokenizer().matcher(params)
        if params.logprob_start_len >= 0:
            req.prompt_logprobs = [None] if params.logprob_start_len == 0 else []
            req.new_prompt_logprobs = len(req.prompt_logprobs)
        return req

    def _check_params(self, params: SamplingParams, prompt_len: int) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            out = [t for t in ids if t >= vocab]
            if out:
                raise ValueError(f"{name}: token id {out[0]} is outside the vocabulary [0, {vocab})")
        if params.message_boundaries and params.message_boundaries[-1] > prompt_len:
            raise ValueError(f"message_boundaries: position {params.message_boundaries[-1]} is past the end of "
                             f"the {prompt_len}-token prompt")
        if params.logprob_start_len >= prompt_len:
            raise ValueError(f"logprob_start_len: {params.logprob_start_len} is not a position of the "
                             f"{prompt_len}-token prompt")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer.json in the checkpoint")

    def grammar_tokenizer(self) -> GrammarTokenizer:
        if self._grammar_tok is None:
            if self.tokenizer is None:
                raise ValueError("grammar: structured output needs a tokenizer.json in the checkpoint")
            self._grammar_tok = GrammarTokenizer(self.tokenizer.to_json(), self.model_config.vocab_size,
                                                 sorted(self.eos_ids))
        return self._grammar_tok

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.status is Status.FINISHED:
            return False
        self._finish(req, "abort")
        return True

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.kv.commit(req, finished=True)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._now += 1.0
        self.cache.poll()
        seqs = self.scheduler.schedule()
        if not seqs:
            if self.cache.prefetching():
                self.cache.wait_prefetch(0.005)   # only prefetching requests: don't spin on the GIL
            return []
        try:
            logits = self.runner.run(seqs)
        finally:
            self.scheduler.after_forward()
        self.hooks.after_forward([sq.req for sq in seqs])
        self.counters["steps"] += 1
        samplers = [sq for sq in seqs if sq.samples]
        self._prompt_logprobs(logits[len(samplers):])
        logits = logits[:len(samplers)]
        toks, lps = sample(logits, [row_state(sq.req, self.eos_ids) for sq in samplers])
        outs: list[StepOutput] = []
        # The step's new prompts are backed up to L2/L3 together when its commits are done (one copy
        # and one store batch for all of them, storage/hicache/write.py).
        with self.cache.batched_writes():
            for sq in seqs:
                req = sq.req
                req.num_computed = sq.end
                key = "decode_tokens" if sq.n == 1 and req.output_ids else "prefill_tokens"
                self.counters[key] += sq.n
                if not sq.samples:
                    # A chunk of a longer prompt: its sliding KV before the window becomes the tree's now
                    # (evictable, matchable), not the request's until the prompt ends.
                    self.kv.commit(req, keep_end=False)
            for i, (sq, tok) in enumerate(zip(samplers, toks)):
                req = sq.req
                if req.params.return_logits:
                    req.logits.append(logits[i].detach().cpu().clone())
                req.output_ids.append(tok)
                if req.matcher is not None:
                    req.matcher.consume(tok)
                if lps[i] is not None:
                    req.logprobs.append(lps[i])
                reason = self._stop_reason(req, tok)
                if req.prefill_only and len(req.output_ids) == 1 and reason is None:
                    # Only a request that goes on elsewhere exports: one its first token ended hands nothing on.
                    req.kv_payload = export_kv(req, self.pools, self.geometry, self.cache.offloads_to)
                    reason = "prefill"
                if reason is not None:
                    self._finish(req, reason)
                elif len(req.output_ids) == 1:
                    self.kv.commit(req)   # the prompt is whole: cache it before decode slides past
                outs.append(self._step_output(req, [tok], [lps[i]] if lps[i] is not None else [], reason))
        return outs

    def _step_output(self, req: Request, toks: list[int], lps: list, reason: str | None) -> StepOutput:
        plp = None
        if req.prompt_logprobs is not None and req.new_prompt_logprobs:
            plp = req.prompt_logprobs[len(req.prompt_logprobs) - req.new_prompt_logprobs:]
            req.new_prompt_logprobs = 0
        return StepOutput(req.rid, toks, reason is not None, reason, lps, plp,
                          req.matched_stop if reason is not None else None)

    def _prompt_logprobs(self, rows: torch.Tensor) -> None:
        """Logits rows [len(runner.prompt_rows), V] -> the prompt-token logprobs of their requests."""
        owners = self.runner.prompt_rows
        if not owners:
            return
        toks = [req.prompt_ids[pos] for req, pos in owners]
        for (req, _pos), lp in zip(owners, token_logprobs(rows, toks, req_top(owners))):
            req.prompt_logprobs.append(lp._replace(top=lp.top[:req.params.top_logprobs]))
            req.new_prompt_logprobs += 1

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        return stop_reason(req, tok, self.eos_ids, self.max_context,
                           lambda ids: self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens))

    def pop_finished(self, rid: str) -> GenerationOutput:
        """The output of a finished request, forgetting the request."""
        out = self.output(rid)
        if self.requests[rid].status is not Status.FINISHED:
            raise ValueError(f"rid: {rid!r} has not finished")
        del self.requests[rid]
        return out

    def output(self, rid: str) -> GenerationOutput:
        req = self.requests[rid]
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens) \
            if self.tokenizer else ""
        return GenerationOutput(rid, list(req.output_ids), text, len(req.prompt_ids), req.cached_tokens,
                                req.finish_reason, list(req.logits), dict(req.cached_by_tier),
                                list(req.logprobs), None if req.prompt_logprobs is None else list(req.prompt_logprobs),
                                req.matched_stop)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        rids = []
        try:
            for p, sp in zip(prompts, params):
                rids.append(self.add_request(p, sp))
        except ValueError:
            for rid in rids:
                self.abort(rid)
            raise
        while any(self.requests[r].status is not Status.FINISHED for r in rids):
            self.step()
        outs = [self.output(r) for r in rids]
        for r in rids:
            self.requests.pop(r, None)  # finished: keep nothing per request past its output
        return outs

    # ---- experts (EPLB) ----------------------------------------------------------------------
    def expert_load(self) -> torch.Tensor:
        """Tokens routed per logical expert since start [layers, experts] int64 (a copy)."""
        return torch.stack([m.expert_counts for m in self.moe_layers]).cpu()

    def expert_reading(self) -> ExpertLoad | None:
        """What the EPLB rebalancer reads (engine/eplb.py ``ExpertLoad``: the counters, the slot placement
        and what each slot served since start), or None without slots."""
        if self.cfg.eplb is None:
            return None
        return ExpertLoad(self.expert_load(), torch.stack([m.slots.slot_counts for m in self.moe_layers]).cpu(),
                          torch.stack([m.slots.phy2log for m in self.moe_layers]).cpu(), self.cfg.eplb.num_ranks,
                          self.counters["steps"])

    def apply_placement(self, phy2log: torch.Tensor) -> PlacementApplied:
        """Moves the expert weights to the placement phy2log [L, P] (engine/eplb.py): every changing
        slot's weights are copied first, then all layers switch their mapping. Call between steps
        (AsyncEngine.call does). Outputs do not change. Raises ValueError (and changes nothing) on a
        bad placement or without slots."""
        if self.cfg.eplb is None:
            raise ValueError("apply_placement: the engine has no expert slots (EngineConfig.eplb is None)")
        try:
            phy2log = torch.as_tensor(phy2log)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"apply_placement: phy2log is not a [layers, slots] tensor of ints: {e}") from None
        t = time.perf_counter()
        moved = moe_slots.apply_placement(self.moe_layers, phy2log)
        return PlacementApplied(moved, time.perf_counter() - t)

    # ---- introspection -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.receiver.check_integrity()
        leased = self.receiver.owners()
        self.cache.check_integrity()
        tree = {c: {"tree": pages} for c, pages in self.cache.owners().items()}
        self.scheduler.check_integrity({c: {**tree.get(c, {}), **leased.get(c, {})} for c in COMPONENTS})

    def close(self) -> None:
        """Finish background copies and release the L3 store (idempotent)."""
        self.cache.close()

    def flush_cache(self, l3: bool = False) -> dict:
        """Empty this engine's tiers (L1, L2, and what its tree knows of L3) and, with ``l3``, this model's
        pages in the L3 store too (shared by the workers of a cluster: one of them clears it, once all
        have flushed). Returns pages dropped per tier and component, and ``L3_store``: objects removed
        from the store (-1 unknown; None when not asked or without L3). Raises RuntimeError while
        requests are running."""
        if self.scheduler.running:
            raise RuntimeError("flush_cache: requests are still running")
        out = self.cache.flush()
        out["L3_store"] = None
        if l3:
            try:
                out["L3_store"] = self.cache.clear_l3()
            except Exception as e:  # noqa: BLE001 - reported: the tiers above are flushed all the same
                out["L3_store_error"] = repr(e)[:300]
        return out

    def stats(self) -> dict:
        p = self.pools
        return {
            **self.counters,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "pool": {c: {"used": p.pool(c).allocator.num_used, "total": p.pool(c).num_pages,
                         "peak": p.pool(c).allocator.peak_used} for c in ("full", "swa")},
            "leases": dataclasses.asdict(self.receiver.stats()),
            "kv_bytes_per_token": {"full": p.full.bytes_per_token, "swa": p.swa.bytes_per_token},
            **self.cache.stats_entry(),
        }
