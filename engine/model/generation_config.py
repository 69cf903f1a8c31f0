"""What a checkpoint's generation_config.json adds: eos ids beyond config.json's, and the sampling defaults a
request that does not set a field gets. Plain JSON, no torch: the ingress reads the defaults too."""
from __future__ import annotations

import json
import os
from pathlib import Path


def generation_eos(path: Path) -> tuple[int, ...]:
    """eos ids from generation_config.json (they often add to config.json's: Llama 3's <|eot_id|>)."""
    p = path / "generation_config.json"
    if not p.is_file():
        return ()
    try:
        eos = json.loads(p.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {p} is not valid JSON ({e})") from None
    return () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))


SAMPLING_DEFAULTS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                     "repetition_penalty": float}


def sampling_defaults(path: str | os.PathLike) -> dict:
    """The sampling defaults a checkpoint's generation_config.json recommends (temperature, top_p,
    top_k, min_p, repetition_penalty): what a request that does not set a field gets, as in vLLM and
    SGLang. Empty when the file is absent."""
    p = Path(path) / "generation_config.json"
    if not p.is_file():
        return {}
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {p} is not valid JSON ({e})") from None
    out = {}
    for k, typ in SAMPLING_DEFAULTS.items():
        if d.get(k) is not None:
            try:
                out[k] = typ(d[k])
            except (TypeError, ValueError):
                raise ValueError(f"model: generation_config.json {k}={d[k]!r} is not a number") from None
    return out
