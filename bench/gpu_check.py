"""One prepared check of strata on a GPU: the copy kernels, the engine and the L1/L2 tiers on CUDA, with
figures against the hardware's limits. Every part that a GPU decides skips on a machine without one
(naming why), and ``--device cpu`` runs the same code on the CPU at small sizes, so the check is
exercised in CI before a GPU is ever at hand (tests/test_gpu_check.py, with Ray, llguidance, Mooncake
and NIXL blocked from importing: the GPU image has none of them).

    python -m bench.gpu_check [--parts env,kernels,bandwidth,engine,speed] [--out DIR] [--device auto|cuda|cpu]
    make gpu-check [GPU_CHECK_PARTS=kernels,engine] [GPU_CHECK_OUT=DIR]

Parts (each runs alone, so a failed one can be rerun by name):

* ``env``: the device, the software stack (torch, Triton, transformers, nvcc) and what imports.
* ``kernels``: every copy kernel (CUDA and Triton; three L2 layouts; both directions; all layers or one;
  scattered pages and runs; L2 pinned on the host or on the device; bf16, fp32 and narrow-vector page
  shapes) against its ``ref_*`` torch oracle, bit for bit over the whole destination tensor.
* ``bandwidth``: L1 <-> L2 page moves of a Llama-3-8B-shaped KV page (32 layers, 8 KV heads, head 128,
  page 16, bf16: 64 KiB per layer-page) through each backend, against the host link (one contiguous
  pinned copy of the same bytes) and against one ``cudaMemcpyAsync`` (``copy_``) per contiguous chunk.
* ``engine``: greedy tokens of each family's tiny checkpoint on the device against transformers (the
  oracle, on the CPU) and against the engine on the CPU, under the numerics policy (tests/numerics.py):
  cold, from L1, from L2 (loaded back on the copier's own stream, layer by layer, beside the forward),
  and prefill on one engine with decode on another (``add_prefilled``). Also a seeded sampled request
  with penalties, bias and logprobs, and the pools' integrity after each.
* ``speed``: a Gemma-3-1B-shaped model (26 layers, 5 sliding : 1 full, random bf16 weights): prefill
  tokens/s, decode tokens/s at batch 1, 8 and 64 against the memory-bandwidth bound (weight and KV
  bytes one step reads / the device's measured copy bandwidth), and the time to first token of an L2
  hit against an L1 hit and against recomputing the prefix.

Writes ``gpu_check.json`` into the output folder (``--out``, else ``$GPU_CHECK_OUT``, else
bench/results/gpu_check) and prints a table per part. Exit status 1 when any part failed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

PARTS = ("env", "kernels", "bandwidth", "engine", "speed")
FAMILIES = ("strata-tiny", "gpt_oss_mxfp4", "llama", "qwen3", "qwen3_moe", "gemma3", "gemma3_legacy")
OPTIONAL = ("ray", "llguidance", "mooncake", "nixl", "triton", "transformers")


class Skip(Exception):
    """A part that cannot run here (no GPU, say); its message is the reason."""


# ---------------------------------------------------------------------------------------------- helpers

class Checks:
    """Named pass/fail results of one part; a failure keeps its error and the part goes on."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @contextlib.contextmanager
    def check(self, name: str, **info):
        row = {"check": name, "ok": False, **info}
        self.rows.append(row)
        try:
            yield row
            row["ok"] = True
        except Exception as e:  # recorded, not raised: the other checks still run
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if not r["ok"]]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after ``warmup``), the device drained around each."""
    for _ in range(warmup):
        fn()
    sync(dev)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def version(mod: str) -> str | None:
    try:
        from importlib.metadata import version as v
        return v(mod)
    except Exception:
        return None


def imports(mod: str) -> str:
    try:
        importlib.import_module(mod)
        return "yes"
    except Exception as e:
        return f"no ({type(e).__name__}: {str(e)[:80]})"


# ------------------------------------------------------------------------------------------------ env

def part_env(dev: torch.device, quick: bool) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(dev),
            "cuda_available": torch.cuda.is_available(), "triton": version("triton"),
            "transformers": version("transformers"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "imports": {m: imports(m) for m in OPTIONAL}}
    from kernels.cuda import loader
    nvcc = loader.nvcc_path()
    info["nvcc"] = nvcc
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        info["nvcc_version"] = out[-1] if out else None
    from storage import tokens
    info["compiled_token_helper"] = bool(getattr(tokens, "COMPILED", False))
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), torch_cuda=torch.version.cuda,
                    matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    return {"info": info}


# -------------------------------------------------------------------------------------------- kernels

# (name, layers, L1 pages, L2 pages, page_size, kv heads, head dim): a page of every vector width the
# CUDA kernel picks (16, 8, 4 bytes and narrower) and short page_first chunks (Triton's CHUNKS > 1).
KERNEL_SHAPES = (("wide", 3, 48, 64, 16, 2, 64), ("narrow", 2, 24, 40, 4, 1, 8), ("odd", 2, 20, 24, 4, 1, 3))


def _rand_bits(shape, dtype, dev, g) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included): the kernels move bits, not numbers."""
    bits = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=g).view(dtype).to(dev)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def part_kernels(dev: torch.device, quick: bool) -> dict:
    import kernels
    from kernels import ref
    from kernels.cuda import loader
    from kernels import triton_copy
    backends = ["torch"]
    if dev.type == "cuda":
        backends = ["cuda", "triton", "torch"]
    elif triton_copy.runnable(dev):
        backends.append("triton")   # the CPU under TRITON_INTERPRET=1
    checks = Checks()
    if dev.type == "cuda":
        with checks.check("cuda library builds and loads"):
            loader.build()
            if not loader.available():
                raise RuntimeError("kernels.cuda.loader.available() is False after a build")
        with checks.check("triton runnable"):
            if not triton_copy.runnable(dev):
                raise RuntimeError("triton is not runnable on this device")
    g = torch.Generator().manual_seed(0)
    n_cases = 0
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
    l2_places = ("pinned",) if dev.type != "cuda" else ("pinned", "device")
    for backend in backends:
        bad: list[dict] = []
        with checks.check(f"{backend}: equals ref_* bit for bit") as row:
            for name, L, p1, p2, ps, h, d in KERNEL_SHAPES:
                E = 2 * ps * h * d
                for dtype in dtypes:
                    for layout in ref.LAYOUTS:
                        for place in l2_places:
                            for direction in (ref.L1_TO_L2, ref.L2_TO_L1):
                                for layer in (None, L - 1):
                                    for pattern in ("scattered", "runs"):
                                        n = min(p1, p2) // 2
                                        if pattern == "scattered":
                                            src = torch.randperm(p1 if direction == ref.L1_TO_L2 else p2, generator=g)[:n]
                                            dst = torch.randperm(p2 if direction == ref.L1_TO_L2 else p1, generator=g)[:n]
                                        else:
                                            src, dst = torch.arange(3, 3 + n), torch.arange(1, 1 + n)
                                        l1 = _rand_bits((L, p1, E), dtype, dev, g)
                                        l2 = _rand_bits(ref.l2_shape(layout, L, p2, ps, E), dtype, "cpu", g)
                                        if place == "pinned" and dev.type == "cuda":
                                            l2 = l2.pin_memory()
                                        elif place == "device":
                                            l2 = l2.to(dev)
                                        want1, want2 = l1.cpu().clone(), l2.cpu().clone()
                                        op = ref.ref_l1_to_l2 if direction == ref.L1_TO_L2 else ref.ref_l2_to_l1
                                        op(want1, want2, layout, src, dst, layer)
                                        fn = kernels.l1_to_l2 if direction == ref.L1_TO_L2 else kernels.l2_to_l1
                                        ran = fn(l1, l2, layout, src, dst, layer, page_size=ps, backend=backend)
                                        sync(dev)
                                        n_cases += 1
                                        ok1 = torch.equal(_bits(l1), _bits(want1))
                                        ok2 = torch.equal(_bits(l2), _bits(want2))
                                        if ran != backend or not (ok1 and ok2):
                                            bad.append({"shape": name, "dtype": str(dtype), "layout": layout,
                                                        "l2": place, "direction": direction, "layer": layer,
                                                        "pattern": pattern, "ran": ran, "l1_equal": ok1,
                                                        "l2_equal": ok2})
            row["cases"] = n_cases
            row["mismatches"] = bad[:20]
            if bad:
                raise AssertionError(f"{len(bad)} of {n_cases} cases differ from ref_*")
            n_cases = 0
    return {"checks": checks.rows}


# ------------------------------------------------------------------------------------------ bandwidth

def part_bandwidth(dev: torch.device, quick: bool) -> dict:
    """GB/s (bytes moved / time, one direction) of L1 <-> L2 page moves."""
    import kernels
    from kernels import ref
    if dev.type == "cuda":
        L, h, d, ps, n_pool, n_move, reps = 32, 8, 128, 16, 512, 256, 5
    else:
        L, h, d, ps, n_pool, n_move, reps = 4, 2, 32, 16, 64, 32, 3
    dtype = torch.bfloat16
    E = 2 * ps * h * d
    g = torch.Generator().manual_seed(1)
    l1 = torch.randn(L, n_pool, E, dtype=dtype, device=dev)
    nbytes = n_move * L * E * l1.element_size()
    backends = ["cuda", "triton", "torch"] if dev.type == "cuda" else ["torch"]
    rows: list[dict] = []
    checks = Checks()
    # The host link: one contiguous copy of the same bytes between the device and pinned memory.
    flat_dev = torch.empty(nbytes // 2, dtype=dtype, device=dev)
    flat_host = torch.empty(nbytes // 2, dtype=dtype, pin_memory=dev.type == "cuda")
    link = {"D2H": timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), dev, reps),
            "H2D": timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), dev, reps)}
    for k, s in link.items():
        rows.append({"what": f"contiguous {k} copy (host link)", "layout": "-", "backend": "torch",
                     "GB/s": nbytes / s / 1e9, "ms": s * 1e3})
    del flat_dev, flat_host
    src = torch.randperm(n_pool, generator=g)[:n_move]
    dst = torch.randperm(n_pool, generator=g)[:n_move]
    for layout in ref.LAYOUTS:
        l2 = kernels.alloc_l2(layout, L, n_pool, ps, E, dtype, pin_memory=dev.type == "cuda")
        v1 = ref.page_view(l1, "l1", layout, ref.chunking(l2, layout)[0], None)
        v2 = ref.page_view(l2, "l2", layout, ref.chunking(l2, layout)[0], None)
        for direction, link_key in ((ref.L1_TO_L2, "D2H"), (ref.L2_TO_L1, "H2D")):
            fn = kernels.l1_to_l2 if direction == ref.L1_TO_L2 else kernels.l2_to_l1
            s_idx, d_idx = (src, dst)
            for backend in backends:
                with checks.check(f"{layout} {direction} {backend}"):
                    s = timed(lambda: fn(l1, l2, layout, s_idx, d_idx, backend=backend, check=False), dev, reps)
                    per_layer = timed(lambda: [fn(l1, l2, layout, s_idx, d_idx, layer=i, backend=backend,
                                                  check=False) for i in range(L)], dev, reps)
                    rows.append({"what": f"{n_move} scattered pages, all layers", "layout": layout,
                                 "direction": direction, "backend": backend, "GB/s": nbytes / s / 1e9,
                                 "ms": s * 1e3, "vs_link": link[link_key] / s,
                                 "layer_by_layer_GB/s": nbytes / per_layer / 1e9})
            # One copy_ (a cudaMemcpyAsync) per contiguous chunk: what a page move costs without a kernel.
            a, b = (v1, v2) if direction == ref.L1_TO_L2 else (v2, v1)
            si = s_idx.tolist()
            di = d_idx.tolist()

            def per_chunk():
                for i, j in zip(si, di):
                    for layer in range(L):
                        b[j, layer].copy_(a[i, layer], non_blocking=True)
            with checks.check(f"{layout} {direction} copy_ per chunk"):
                s = timed(per_chunk, dev, max(1, reps // 2))
                rows.append({"what": "copy_ per (page, layer) chunk", "layout": layout, "direction": direction,
                             "backend": "memcpy", "GB/s": nbytes / s / 1e9, "ms": s * 1e3,
                             "vs_link": link[link_key] / s})
        del l2
    best = {}
    for r in rows:
        if r["backend"] in ("cuda", "triton"):
            key = (r["layout"], r["direction"])
            memcpy = next((x for x in rows if x["backend"] == "memcpy" and x["layout"] == r["layout"]
                           and x.get("direction") == r["direction"]), None)
            if memcpy:
                r["vs_copy_per_chunk"] = memcpy["ms"] / r["ms"]
            best[key] = max(best.get(key, 0.0), r["GB/s"])
    return {"checks": checks.rows, "rows": rows,
            "shape": {"layers": L, "kv_heads": h, "head_dim": d, "page_size": ps, "dtype": "bfloat16",
                      "bytes_per_layer_page": E * 2, "pages_moved": n_move, "bytes_moved": nbytes}}


# --------------------------------------------------------------------------------------------- engine

def _family_checkpoint(name: str, root: Path):
    """(checkpoint path, transformers' model on it) for a family of tests/models/families.py."""
    if name == "strata-tiny":
        from engine.model.loader import ensure_tiny
        from tests.unit.hf_ref import load_hf
        path = ensure_tiny()
        return path, load_hf(path)
    from tests.models.families import load_hf, write_family
    path = write_family(name, root / name, shard=name in ("qwen3", "gemma3"))
    return path, load_hf(name, path)


def _prompts(name: str, seed: int = 3) -> list[list[int]]:
    from tests.models.families import WINDOWS
    w = WINDOWS.get(name, 64 if name == "strata-tiny" else 16)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, w + 1, 3 * w + 5, 6 * w)]


def _engine(path, device: str, **kw):
    from engine import Engine
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 512)
    kw.setdefault("max_batch_tokens", 40)
    return Engine.from_pretrained(str(path), device=device, poison_kv=True, **kw)


def _family(name: str, root: Path, dev: torch.device, checks: Checks) -> None:
    """Each way of serving a prompt on ``dev`` (cold, from L1, from L2, P/D) against two references:
    the engine on the CPU, and transformers. Judged apart, so that an oracle of another transformers
    version cannot hide (or stand in for) what the device computes."""
    from engine import SamplingParams
    from storage.config import HiCacheConfig
    from tests import numerics
    from tests.unit.hf_ref import hf_greedy
    n_new = 10
    sp = numerics.with_logits(SamplingParams(max_new_tokens=n_new, ignore_eos=True))
    with checks.check(f"{name}: checkpoint and transformers' answers") as row:
        path, hf = _family_checkpoint(name, root)
        prompts = _prompts(name)
        g = torch.Generator().manual_seed(11)
        # A second turn: the longest prompt, a first answer, and new tokens (its prefix is cached).
        cpu = _engine(path, "cpu")
        turn1 = cpu.generate([prompts[-1]], sp)[0].token_ids
        turn2 = prompts[-1] + turn1 + torch.randint(0, 256, (37,), generator=g).tolist()
        everything = prompts + [turn2]
        hf_ref = {tuple(p): hf_greedy(hf, p, n_new) for p in everything}
        cpu_ref = {tuple(p): o for p, o in zip(everything, cpu.generate(everything, sp))}
        mc = cpu.model_config
        row["prompts"] = [len(p) for p in everything]
    if not checks.rows[-1]["ok"]:
        return
    if mc.architecture == "GptOssForCausalLM":   # same expert tensors in both (MXFP4 dequantized at load)
        with checks.check(f"{name}: transformers' expert weights = strata's (bit for bit)") as row:
            ours = dict(cpu.model.named_parameters())
            diff = {n: float((p.detach().float() - ours[n].detach().float()).abs().max())
                    for n, p in hf.named_parameters() if ".experts." in n}
            row["max_abs_diff"] = max(diff.values())
            bad = {n: d for n, d in diff.items() if d != 0}
            assert not bad, f"{len(bad)} of {len(diff)} expert tensors differ, e.g. {next(iter(bad.items()))}"
    device = str(dev)
    got: list[tuple[str, list[int], object]] = []   # (what, prompt, output)
    with checks.check(f"{name}: {device} cold prefill, chunked") as row:
        eng = _engine(path, device)
        assert eng.pools.full.kv.device.type == dev.type, eng.pools.full.kv.device
        got += [(f"cold, prompt of {len(p)}", p, o) for p, o in zip(prompts, eng.generate(prompts, sp))]
        assert eng.pools.all_free()
        eng.check_integrity()
    with checks.check(f"{name}: {device} prefix from L1, then from L2 (layer-wise load-back)") as row:
        a = _engine(path, device, enable_prefix_cache=True, hicache=HiCacheConfig(host_pages=512))
        a.generate([prompts[-1]], sp)
        from_l1 = a.generate([turn2], sp)[0]
        assert from_l1.cached_tokens_by_tier["L1"] > 0, from_l1.cached_tokens_by_tier
        a.cache.poll(block=True)
        for c in ("full", "swa"):
            a.cache.evict_l1(c, 1 << 30)
        from_l2 = a.generate([turn2], sp)[0]
        assert from_l2.cached_tokens_by_tier["L2"] > 0 and from_l2.cached_tokens_by_tier["L1"] == 0, \
            from_l2.cached_tokens_by_tier
        got += [("from L1", turn2, from_l1), ("from L2", turn2, from_l2)]
        row["cached"] = {"L1": from_l1.cached_tokens_by_tier["L1"], "L2": from_l2.cached_tokens_by_tier["L2"]}
        row["loadback"] = dict(a.cache.stats["loadback"])
        row["copier_stream"] = a.cache.copier.stream is not None
        a.check_integrity()
        a.flush_cache()
        assert a.pools.all_free()
        a.close()
    with checks.check(f"{name}: {device} prefill on one engine, decode on another (add_prefilled)"):
        pre, dec = _engine(path, device), _engine(path, device)
        rids = [pre.add_request(p, sp, prefill_only=True) for p in prompts[2:]]
        while pre.has_unfinished():
            pre.step()
        payloads = [pre.requests[r].kv_payload for r in rids]
        for r in rids:
            pre.pop_finished(r)
        drids = [dec.add_prefilled(p, kv, sp) for p, kv in zip(prompts[2:], payloads)]
        while dec.has_unfinished():
            dec.step()
            dec.check_integrity()
        # Tokens only: the decode engine's first token came with the payload, so its logits start at step 1.
        got += [(f"P/D, prompt of {len(p)}", p, dec.pop_finished(r).token_ids) for p, r in zip(prompts[2:], drids)]
        assert pre.pools.all_free() and dec.pools.all_free()
    for ref_name, refs in (("the engine on cpu", cpu_ref), ("transformers", hf_ref)):
        with checks.check(f"{name}: {device} tokens and logits = {ref_name}", compared=len(got)) as row:
            deps = [numerics.assert_same_output(o, refs[tuple(p)], mc, f"{name} {device} {what} vs {ref_name}")
                    for what, p, o in got]
            row["excused_departures"] = sum(d is not None for d in deps)
    with checks.check(f"{name}: {device} sampled request (seed, penalties, bias, logprobs)") as row:
        ssp = SamplingParams(max_new_tokens=n_new, temperature=0.8, top_p=0.9, top_k=40, min_p=0.01,
                             seed=1234, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
                             logit_bias=((7, 2.0),), logprobs=True, top_logprobs=3, ignore_eos=True)
        o = eng.generate([prompts[3]], ssp)[0]
        oc = cpu.generate([prompts[3]], ssp)[0]
        assert len(o.token_ids) == n_new and all(0 <= t < mc.vocab_size for t in o.token_ids), o.token_ids
        assert len(o.logprobs) == n_new and all(lp.logprob <= 0 and len(lp.top) == 3 for lp in o.logprobs)
        # Same seed, same race: the tokens match the CPU's unless rounding noise moved a draw (reported).
        row["same_tokens_as_cpu"] = o.token_ids == oc.token_ids


def part_engine(dev: torch.device, quick: bool, families=None) -> dict:
    checks = Checks()
    families = families or (("strata-tiny", "gemma3") if quick else FAMILIES)
    with tempfile.TemporaryDirectory(prefix="strata-gpu-check-") as d:
        for name in families:
            _family(name, Path(d), dev, checks)
    return {"checks": checks.rows, "families": list(families)}


# ---------------------------------------------------------------------------------------------- speed

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


def part_speed(dev: torch.device, quick: bool) -> dict:
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


# ----------------------------------------------------------------------------------------------- main

def _table(rows: list[dict], cols: list[str]) -> str:
    from bench.common import table
    return table(rows, cols)


def report(results: dict) -> str:
    lines = []
    for name, r in results["parts"].items():
        lines.append(f"\n== {name}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else ""))
        if name == "env" and "info" in r:
            lines += [f"  {k}: {v}" for k, v in r["info"].items()]
        if r.get("checks"):
            plain = ("check", "ok", "error", "traceback", "mismatches", "loadback")
            lines.append(_table([{"check": c["check"], "ok": "ok" if c["ok"] else "FAIL",
                                  "error / details": (c.get("error") or json.dumps(
                                      {k: v for k, v in c.items() if k not in plain}, default=str))[:150]}
                                 for c in r["checks"]], ["check", "ok", "error / details"]))
        if r.get("rows"):
            cols = [c for c in ("what", "layout", "direction", "backend", "GB/s", "layer_by_layer_GB/s",
                                "vs_link", "vs_copy_per_chunk", "tokens/s", "ms", "bound_ms", "of_bound")
                    if any(c in x for x in r["rows"])]
            lines.append(_table(r["rows"], cols))
        if "device_copy_GB/s" in r:
            lines.append(f"  device copy bandwidth (read + write): {r['device_copy_GB/s']:,.0f} GB/s")
    return "\n".join(lines)


def run(parts, device: str, quick: bool, families=None, on_part=None) -> dict:
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        gpu_only = not torch.cuda.is_available()
    else:
        dev = torch.device(device)
        gpu_only = False
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
    fns = {"env": part_env, "kernels": part_kernels, "bandwidth": part_bandwidth,
           "engine": lambda d, q: part_engine(d, q, families), "speed": part_speed}
    results = {"device": str(dev), "quick": quick, "parts": {}}
    for name in parts:
        t = time.perf_counter()
        try:
            if gpu_only and name != "env":
                raise Skip("no CUDA device (torch.cuda.is_available() is False); --device cpu runs it on the CPU")
            r = fns[name](dev, quick)
            failed = [c for c in r.get("checks", []) if not c["ok"]]
            r["status"] = "FAIL" if failed else "pass"
        except Skip as e:
            r = {"status": "skip", "reason": str(e)}
        except Exception as e:
            r = {"status": "FAIL", "reason": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        r["seconds"] = round(time.perf_counter() - t, 2)
        results["parts"][name] = r
        print(f"[gpu-check] {name}: {r['status']} in {r['seconds']} s", flush=True)
        if on_part is not None:
            on_part(results)   # written as it goes: a run cut short keeps the parts it finished
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=os.environ.get("GPU_CHECK_PARTS") or ",".join(PARTS))
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or str(Path(__file__).parent / "results" / "gpu_check"))
    ap.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", "auto"), choices=("auto", "cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", default=os.environ.get("GPU_CHECK_QUICK") == "1",
                    help="small sizes and two families (what the CPU run in the tests uses)")
    ap.add_argument("--families", default=os.environ.get("GPU_CHECK_FAMILIES"),
                    help=f"comma-separated, of {','.join(FAMILIES)}")
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    families = tuple(f.strip() for f in a.families.split(",")) if a.families else None
    if families and set(families) - set(FAMILIES):
        ap.error(f"unknown families {sorted(set(families) - set(FAMILIES))}; choose from {','.join(FAMILIES)}")
    # fp32 comparisons mean fp32: TF32 would round the engine's matmuls to 10-bit mantissas.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("STRATA_HOME", tempfile.mkdtemp(prefix="strata-home-"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench.common import machine

    def write(results: dict) -> None:
        (out / "gpu_check.json").write_text(json.dumps({"machine": machine(), **results}, indent=2, default=str))
    results = run(parts, a.device, a.quick, families, on_part=write)
    print(report(results))
    print(f"\nwrote {out / 'gpu_check.json'}")
    return 1 if any(r["status"] == "FAIL" for r in results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
