"""Where a model's checkpoint is: a directory with ``config.json`` (and safetensors), or ``strata-tiny``,
generated into ``STRATA_HOME`` on first use so that nothing is ever downloaded. No torch here unless the
tiny checkpoint has to be made: the launcher finds and checks a checkpoint without loading the engine
(engine/model/loader.py loads it)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

TINY_NAME = "strata-tiny"


def strata_home() -> Path:
    return Path(os.environ.get("STRATA_HOME") or Path.home() / ".cache" / "strata")


def ensure_tiny(seed: int = 0) -> Path:
    """The strata-tiny checkpoint directory, generated once (under a file lock) into STRATA_HOME."""
    root = strata_home() / "models"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{TINY_NAME}-s{seed}"
    if (target / "config.json").is_file():
        return target
    with open(root / f".{TINY_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            tmp = root / f".{TINY_NAME}-s{seed}.tmp{os.getpid()}"
            from engine.model.loader import random_state_dict, save_checkpoint, tiny_config   # torch: only to build it
            cfg = tiny_config()
            save_checkpoint(tmp, cfg, random_state_dict(cfg, seed))
            os.replace(tmp, target)
    return target


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    if str(name_or_path) == TINY_NAME:
        return ensure_tiny()
    p = Path(name_or_path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(f"model: {str(name_or_path)!r} is neither {TINY_NAME!r} nor a checkpoint "
                         "directory with config.json")
    return p
