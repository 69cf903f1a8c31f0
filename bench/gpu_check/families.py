"""The engine part: each family's tiny checkpoint on the device against the engine on the CPU and against
transformers, under the numerics policy (tests/numerics.py): cold, from L1, from L2, and P/D."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.gpu_check.checks import Checks

FAMILIES = ("strata-tiny", "gpt_oss_mxfp4", "llama", "qwen3", "qwen3_moe", "gemma3", "gemma3_legacy")


def _family_checkpoint(name: str, root: Path):
    """(checkpoint path, transformers' model on it) for a family of tests/models/families.py."""
    if name == "strata-tiny":
        from engine.model.checkpoint import ensure_tiny
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
    from tests import numerics, pd
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
    with checks.check(f"{name}: {device} prefill on one engine, decode on another (leased, ray_object fill)"):
        pre, dec = _engine(path, device), _engine(path, device)
        drids = pd.handoff(pre, dec, prompts[2:], sp)
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


def run(dev: torch.device, quick: bool, families=None) -> dict:
    checks = Checks()
    families = families or (("strata-tiny", "gemma3") if quick else FAMILIES)
    with tempfile.TemporaryDirectory(prefix="strata-gpu-check-") as d:
        for name in families:
            _family(name, Path(d), dev, checks)
    return {"checks": checks.rows, "families": list(families)}
