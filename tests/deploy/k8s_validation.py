"""Validation of rendered Kubernetes objects, offline: the KubeRay kinds with jsonschema against the
``openAPIV3Schema`` of the KubeRay CRDs in ../shared/kuberay-crds, made strict (an unknown field is an
error, as with ``kubectl apply``'s default strict field validation); the core kinds with
kubernetes-validate in strict mode; and the rules the KubeRay operator checks when it reconciles (which
no schema carries)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayCronJob": "ray.io_raycronjobs.yaml", "RayService": "ray.io_rayservices.yaml"}
K8S_VERSION = "1.32.0"          # the API the manifests target (kubectl here is 1.32)


def _load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _strict(schema):
    """Forbid fields a structural schema does not list (unless it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str, version: str):
    """A strict validator of one KubeRay kind, or None when its CRD file is absent."""
    path = CRD_DIR / CRD_FILES[kind]
    if not path.is_file():
        return None
    crd = _load_yaml(path)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return jsonschema.Draft7Validator(_strict(v["schema"]["openAPIV3Schema"]))
    raise AssertionError(f"{path.name} has no version {version}")


def crd_errors(obj: dict) -> list[str]:
    """Schema violations of a KubeRay object (each as 'path: message'), [] when valid."""
    kind, version = obj["kind"], obj["apiVersion"].split("/")[-1]
    v = crd_validator(kind, version)
    prefix = ""
    if v is None and kind == "RayService":
        # No RayService CRD in the folder: its cluster is a RayCluster spec and is checked as one; the rest
        # (serveConfigV2, a string, and serveService) has no schema here to be checked against.
        v = jsonschema.Draft7Validator(crd_validator("RayCluster", version).schema["properties"]["spec"])
        obj, prefix = obj["spec"]["rayClusterConfig"], "spec.rayClusterConfig."
    return [f"{prefix}{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(obj)]


def core_errors(obj: dict) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


def errors(obj: dict) -> list[str]:
    return crd_errors(obj) if obj["apiVersion"].startswith("ray.io/") else core_errors(obj)


# ---- rules the KubeRay operator enforces beyond the schema (checked when it reconciles, not at apply) ----
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
CRON_FIELD = re.compile(r"(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*")


def operator_errors(obj: dict) -> list[str]:
    kind, spec, errs = obj["kind"], obj["spec"], []
    name = obj["metadata"]["name"]
    if kind in ("RayCluster", "RayJob", "RayService", "RayCronJob") and \
            not (DNS1035.fullmatch(name) and len(name) <= 63):
        errs.append(f"name {name!r} is not a DNS-1035 label")
    clusters = [spec] if kind == "RayCluster" else [spec["rayClusterConfig"]] if kind == "RayService" else []
    jobs = [spec] if kind == "RayJob" else [spec["jobTemplate"]] if kind == "RayCronJob" else []
    for c in clusters:
        for g in [c["headGroupSpec"]] + c.get("workerGroupSpecs", []):
            params = g.get("rayStartParams", {})
            if g.get("resources") and any(k in params for k in ("num-cpus", "num-gpus", "memory", "resources")):
                errs.append("group resources set both in rayStartParams and in resources")
            if "labels" in params:
                errs.append("rayStartParams.labels is not supported (use the group's labels)")
            if not g["template"]["spec"].get("containers"):
                errs.append("a group without containers")
    if kind == "RayService" and spec["rayClusterConfig"]["headGroupSpec"].get("headService", {}) \
            .get("metadata", {}).get("name"):
        errs.append("rayClusterConfig.headGroupSpec.headService.metadata.name must not be set")
    for j in jobs:
        if j.get("clusterSelector"):
            if not j["clusterSelector"].get("ray.io/cluster"):
                errs.append("clusterSelector without a ray.io/cluster name")
            if j.get("submissionMode") == "SidecarMode" or j.get("suspend"):
                errs.append("clusterSelector with SidecarMode or suspend")
        elif "rayClusterSpec" not in j:
            errs.append("a RayJob needs rayClusterSpec or clusterSelector")
        if j.get("ttlSecondsAfterFinished", 0) > 0 and not j.get("shutdownAfterJobFinishes"):
            errs.append("ttlSecondsAfterFinished without shutdownAfterJobFinishes")
    if kind == "RayCronJob":
        fields = spec["schedule"].split()
        if len(fields) != 5 or not all(CRON_FIELD.fullmatch(f) for f in fields):
            errs.append(f"schedule {spec['schedule']!r} is not a standard 5-field cron expression")
    return errs
