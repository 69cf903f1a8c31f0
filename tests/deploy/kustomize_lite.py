"""A pure-Python renderer for the subset of kustomize that manifests/ uses, for machines without kubectl:

    python -m tests.deploy.kustomize_lite manifests/overlays/cpu-tiny > rendered.yaml

Supported (anything else raises ``Unsupported``, so a kustomization that outgrows this file fails loudly
instead of rendering wrong): ``resources`` (files and directories with a kustomization), ``images``
(name, newName, newTag, digest; every ``containers``/``initContainers`` entry, custom resources
included), ``configMapGenerator`` (files and literals; behavior create, replace, merge) with
``generatorOptions.disableNameSuffixHash: true``, ``patches`` given as RFC 6902 operation lists
(add, replace, remove) with a kind/name target, and ``replacements`` from one field to dotted field paths.
Transformers run in kustomize's order: resources, generators, patches, images, replacements.
tests/deploy/test_manifests.py compares this renderer's output with ``kubectl kustomize``.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_KEYS = {"apiVersion", "kind", "resources", "images", "configMapGenerator", "generatorOptions",
              "patches", "replacements"}


class Unsupported(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def _kustomization_file(d: Path) -> Path:
    for n in KUSTOMIZATION_NAMES:
        if (d / n).is_file():
            return d / n
    raise FileNotFoundError(f"no kustomization in {d}")


def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _ident(obj: dict) -> tuple[str, str]:
    return obj.get("kind", ""), obj.get("metadata", {}).get("name", "")


def _matches(obj: dict, sel: dict) -> bool:
    unknown = set(sel) - {"kind", "name"}
    if unknown:
        raise Unsupported(f"target selector keys {sorted(unknown)}")
    kind, name = _ident(obj)
    return sel.get("kind", kind) == kind and sel.get("name", name) == name


# ---- RFC 6902 ------------------------------------------------------------------------------------------
def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _apply_op(doc: Any, op: dict) -> None:
    *parents, last = _pointer(op["path"])
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    kind = op["op"]
    if kind not in ("add", "replace", "remove"):
        raise Unsupported(f"JSON patch op {kind!r}")
    if isinstance(node, list):
        if kind == "add":
            idx = len(node) if last == "-" else int(last)
            if not 0 <= idx <= len(node):
                raise IndexError(f"{op['path']}: index out of range")
            node.insert(idx, copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            del node[int(last)]
    else:
        if kind in ("replace", "remove") and last not in node:
            raise KeyError(f"{op['path']}: no such field to {kind}")
        if kind == "remove":
            del node[last]
        else:
            node[last] = copy.deepcopy(op["value"])


# ---- transformers --------------------------------------------------------------------------------------
def _split_image(image: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; a registry port's ':' is not a tag separator."""
    name, digest = (image.split("@", 1) + [""])[:2]
    tag = ""
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest


def _set_images(node: Any, images: list[dict], under_containers: bool = False) -> None:
    if isinstance(node, dict):
        if under_containers and isinstance(node.get("image"), str):
            name, tag, digest = _split_image(node["image"])
            for im in images:
                if im["name"] == name:
                    new = im.get("newName", name)
                    if im.get("digest"):
                        node["image"] = f"{new}@{im['digest']}"
                    elif im.get("newTag"):
                        node["image"] = f"{new}:{im['newTag']}"
                    else:
                        node["image"] = new + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
                    break
        for k, v in node.items():
            _set_images(v, images, k in ("containers", "initContainers") and isinstance(v, list))
    elif isinstance(node, list):
        for v in node:
            _set_images(v, images, under_containers)


def _get_path(obj: dict, dotted: str) -> Any:
    node: Any = obj
    for part in dotted.split("."):
        if "[" in part:
            raise Unsupported(f"field path with a list selector: {dotted!r}")
        node = node[part]
    return node


def _set_path(obj: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = _get_path(obj, ".".join(parents)) if parents else obj
    if "[" in last:
        raise Unsupported(f"field path with a list selector: {dotted!r}")
    if last not in node:
        raise KeyError(f"replacement target field {dotted!r} does not exist")
    node[last] = copy.deepcopy(value)


def _replace(objs: list[dict], replacements: list[dict]) -> None:
    for r in replacements:
        src = r["source"]
        found = [o for o in objs if _matches(o, {k: src[k] for k in ("kind", "name") if k in src})]
        if len(found) != 1:
            raise ValueError(f"replacement source {src} matches {len(found)} objects")
        value = _get_path(found[0], src.get("fieldPath", "metadata.name"))
        for t in r["targets"]:
            if set(t) - {"select", "fieldPaths"}:
                raise Unsupported(f"replacement target keys {sorted(t)}")
            for o in objs:
                if _matches(o, t["select"]):
                    for fp in t["fieldPaths"]:
                        _set_path(o, fp, value)


def _configmap(gen: dict, base_dir: Path) -> dict:
    if set(gen) - {"name", "files", "literals", "behavior"}:
        raise Unsupported(f"configMapGenerator keys {sorted(gen)}")
    data: dict[str, str] = {}
    for f in gen.get("files", []):
        key, _, rel = f.rpartition("=") if "=" in f else ("", "", f)
        data[key or Path(rel).name] = (base_dir / rel).read_text()
    for lit in gen.get("literals", []):
        k, _, v = lit.partition("=")
        data[k] = v
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}


# ---- the kustomization ---------------------------------------------------------------------------------
def render(directory: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize DIRECTORY`` would print (as dicts; order not guaranteed)."""
    d = Path(directory).resolve()
    k = yaml.safe_load(_kustomization_file(d).read_text()) or {}
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise Unsupported(f"{d}: kustomization keys {sorted(unknown)}")
    objs: list[dict] = []
    for res in k.get("resources", []):
        p = d / res
        objs.extend(render(p) if p.is_dir() else _load_docs(p))
    gens = k.get("configMapGenerator", [])
    if gens and not (k.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        raise Unsupported("configMapGenerator without generatorOptions.disableNameSuffixHash: true")
    for gen in gens:
        new = _configmap(gen, d)
        behavior = gen.get("behavior", "create")
        existing = [o for o in objs if _ident(o) == ("ConfigMap", gen["name"])]
        if behavior == "create":
            if existing:
                raise ValueError(f"ConfigMap {gen['name']} already exists (use behavior: replace or merge)")
            objs.append(new)
        elif behavior in ("replace", "merge"):
            if len(existing) != 1:
                raise ValueError(f"ConfigMap {gen['name']} to {behavior} not found")
            if behavior == "replace":
                existing[0]["data"] = new["data"]
            else:
                existing[0].setdefault("data", {}).update(new["data"])
        else:
            raise Unsupported(f"configMapGenerator behavior {behavior!r}")
    for patch in k.get("patches", []):
        if set(patch) - {"path", "target"} or "target" not in patch:
            raise Unsupported(f"patch {patch}: only a path to a JSON 6902 op list with a target")
        ops = yaml.safe_load((d / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise Unsupported(f"{patch['path']}: a strategic merge patch (only RFC 6902 op lists)")
        targets = [o for o in objs if _matches(o, patch["target"])]
        if not targets:
            raise ValueError(f"patch target {patch['target']} matches nothing")
        for o in targets:
            for op in ops:
                _apply_op(o, op)
    if k.get("images"):
        for im in k["images"]:
            if set(im) - {"name", "newName", "newTag", "digest"}:
                raise Unsupported(f"images entry {im}")
        _set_images(objs, k["images"])
    _replace(objs, k.get("replacements", []))
    return objs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests.deploy.kustomize_lite DIRECTORY", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(render(args[0]), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
