"""The speed part: a Gemma-3-1B-shaped model's prefill and decode rates against the memory-bandwidth
bound, where a decode step's time goes, and the time to first token per cache tier."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_check.checks import Checks, sync, timed


def _gemma3_1b(path: Path, dev: torch.device, quick: bool) -> Path:
    """A checkpoint of Gemma 3 1B's shape with random bf16 weights (transformers writes it)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    if quick:
        shape = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=16)
    else:
        shape = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    cfg = Gemma3TextConfig(**shape, query_pre_attn_scalar=256, max_position_embeddings=32768,
                           eos_token_id=1, pad_token_id=0, bos_token_id=2,
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)   # no tokenizer: the bench sends token ids
    del model
    return path


def _device_bandwidth(dev: torch.device) -> float:
    """Bytes/s a large device-to-device copy reaches (read + write counted)."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), dev, 5)
    return 2 * n / s


def _decode_rate(eng, batch: int, prompt_len: int, n_new: int, g) -> dict:
    """Decode tokens/s of ``batch`` requests stepping together (timed after every prompt is in)."""
    from engine import SamplingParams
    sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    rids = [eng.add_request(torch.randint(3, 250, (prompt_len,), generator=g).tolist(), sp) for _ in range(batch)]
    while any(not eng.requests[r].output_ids for r in rids):
        eng.step()
    sync(eng.device)
    t, steps, tokens = time.perf_counter(), 0, 0
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
        steps += 1
    sync(eng.device)
    s = time.perf_counter() - t
    for r in rids:
        eng.pop_finished(r)
    return {"seconds": s, "steps": steps, "tokens": tokens}


def _step_profile(eng, batch: int, prompt_len: int, g, steps: int = 5) -> dict:
    """Where a decode step's time goes on a GPU: kernels launched per step and the share of the step's
    wall time the device spends in kernels (the rest is the host: Python, launches, syncs)."""
    from torch.profiler import ProfilerActivity, profile
    from engine import SamplingParams
    sp = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    rids = [eng.add_request(torch.randint(3, 250, (prompt_len,), generator=g).tolist(), sp) for _ in range(batch)]
    while any(not eng.requests[r].output_ids for r in rids):
        eng.step()
    sync(eng.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(eng.device)
        wall = time.perf_counter() - t
    while eng.has_unfinished():
        eng.step()
    for r in rids:
        eng.pop_finished(r)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6     # us -> s (overlaps ignored: an upper bound)
    return {"kernels_per_step": len(kernels) / steps, "device_busy_share": busy / wall,
            "step_ms": wall / steps * 1e3}


def _first_token_s(eng, prompt: list[int]) -> float:
    from engine import SamplingParams
    sync(eng.device)
    t = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    while not eng.step():
        pass
    sync(eng.device)
    dt = time.perf_counter() - t
    eng.pop_finished(rid)
    return dt


def run(dev: torch.device, quick: bool) -> dict:
    from engine import Engine, SamplingParams
    from storage.config import HiCacheConfig
    checks = Checks()
    rows: list[dict] = []
    out: dict = {"checks": checks.rows, "rows": rows}
    prompt_len = 2048 if not quick else 96
    with tempfile.TemporaryDirectory(prefix="strata-gpu-speed-") as d:
        with checks.check("Gemma-3-1B-shaped checkpoint (random bf16)") as row:
            t = time.perf_counter()
            path = _gemma3_1b(Path(d) / "gemma3-1b-shape", dev, quick)
            row["seconds"] = time.perf_counter() - t
        if not checks.rows[-1]["ok"]:
            return out
        with checks.check("engine loads") as row:
            eng = Engine.from_pretrained(str(path), device=str(dev), dtype="bfloat16", page_size=16,
                                         num_pages=8192 if not quick else 256, max_batch_tokens=prompt_len,
                                         max_running_requests=64, enable_prefix_cache=True,
                                         hicache=HiCacheConfig(host_pages=8192 if not quick else 256))
            mc = eng.model_config
            weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
            emb = mc.vocab_size * mc.hidden_size * 2
            row.update(layers=mc.num_hidden_layers, sliding=len(mc.sliding_layers), window=mc.sliding_window,
                       weight_gb=weight_bytes / 1e9)
        if not checks.rows[-1]["ok"]:
            return out
        bw = _device_bandwidth(dev)
        out["device_copy_GB/s"] = bw / 1e9
        g = torch.Generator().manual_seed(5)
        prompt = torch.randint(3, 250, (prompt_len,), generator=g).tolist()
        with checks.check("prefill"):
            def prefill():
                eng.flush_cache()
                eng.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
            s = timed(prefill, dev, 3)
            rows.append({"what": f"prefill {prompt_len} tokens, batch 1", "tokens/s": prompt_len / s, "ms": s * 1e3})
        # KV bytes one decode step reads per request at context c: every full layer's c positions, the
        # sliding layers' window; weights: every parameter but the embedding rows not looked up (the
        # tied LM head reads the whole table once).
        kv_tok = 2 * mc.num_key_value_heads * mc.head_dim * 2
        n_full = mc.num_hidden_layers - len(mc.sliding_layers)
        ctx_len = 256 if not quick else 32
        n_new = 64 if not quick else 8
        for batch in ((1, 8, 64) if not quick else (1, 4)):
            with checks.check(f"decode batch {batch}"):
                eng.flush_cache()
                r = _decode_rate(eng, batch, ctx_len, n_new, g)
                ctx = ctx_len + n_new / 2
                step_bytes = weight_bytes + batch * kv_tok * (n_full * ctx + len(mc.sliding_layers)
                                                              * min(ctx, mc.sliding_window or ctx))
                step_s = r["seconds"] / r["steps"]
                bound_s = step_bytes / (bw / 2)   # the copy counted read + write; a step mostly reads
                rows.append({"what": f"decode, batch {batch}, context ~{int(ctx)}", "tokens/s": r["tokens"] / r["seconds"],
                             "ms": step_s * 1e3, "bound_ms": bound_s * 1e3, "of_bound": bound_s / step_s})
        if dev.type == "cuda":
            for batch in (1, 64):
                with checks.check(f"decode step profile, batch {batch}") as row:
                    eng.flush_cache()
                    row.update(_step_profile(eng, batch, ctx_len, g))
        with checks.check("TTFT: L1 hit, L2 hit, recompute") as row:
            tail = lambda: torch.randint(3, 250, (16,), generator=g).tolist()
            from bench.loadback import _whole_load
            times: dict[str, list[float]] = {"L1 hit": [], "L2 hit": [], "L2 hit, whole load first": [],
                                             "recompute": []}
            eng.flush_cache()
            _first_token_s(eng, prompt + tail())
            for _ in range(3):
                times["L1 hit"].append(_first_token_s(eng, prompt + tail()))
                for case, whole in (("L2 hit", False), ("L2 hit, whole load first", True)):
                    eng.cache.poll(block=True)
                    for c in ("full", "swa"):
                        eng.cache.evict_l1(c, 1 << 30)
                    with _whole_load(whole):   # the forward waits for every layer before its first
                        times[case].append(_first_token_s(eng, prompt + tail()))
                    eng.cache.poll(block=True)
                eng.flush_cache()
                times["recompute"].append(_first_token_s(eng, prompt + tail()))
            for k, v in times.items():
                rows.append({"what": f"TTFT, {prompt_len}-token prefix + 16 new: {k}", "ms": statistics.median(v) * 1e3})
            row["loadback"] = dict(eng.cache.stats["loadback"])
        eng.close()
    return out
