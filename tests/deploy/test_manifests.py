"""manifests/ rendered and validated offline, and held to the code.

Every overlay is rendered by the pure-Python renderer (tests/deploy/kustomize_lite.py) and, where kubectl
exists, by ``kubectl kustomize`` too (the two must agree). Every object is validated
(tests/deploy/k8s_validation.py): the KubeRay kinds against the CRD schemas in ../shared/kuberay-crds,
the core kinds with kubernetes-validate, both strict, plus the KubeRay operator's own rules. The cluster
YAML in each rendered ConfigMap is loaded by cluster/config.py, and its numbers are checked against the
pods that must carry them.
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
import math
import re
import shutil
import subprocess

import pytest
import yaml

from cluster.config import ClusterConfig, from_text
from cluster.front import front_env
from cluster.launch import RAY_ENV
from tests.deploy.k8s_validation import (CRD_DIR, CRD_FILES, ROOT, crd_errors, crd_validator, errors,
                                         operator_errors)
from tests.deploy.kustomize_lite import render

MANIFESTS = ROOT / "manifests"
OVERLAYS = sorted(p.name for p in (MANIFESTS / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBECTL = shutil.which("kubectl")
CONFIG_MOUNT = "/etc/strata"
GiB = 1 << 30


@functools.lru_cache(maxsize=None)
def rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(render(MANIFESTS / "overlays" / overlay))


def objects(overlay: str) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in rendered(overlay)}


needs_crds = pytest.mark.skipif(not (CRD_DIR / CRD_FILES["RayCluster"]).is_file(),
                                reason=f"no KubeRay CRDs at {CRD_DIR} (../shared/kuberay-crds next to the repo)")


# ---- rendering -----------------------------------------------------------------------------------------
def test_overlays_exist():
    assert {"cpu-tiny", "gpu"} <= set(OVERLAYS)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed: the pure-Python render stands alone")
@pytest.mark.parametrize("overlay", ["../base"] + OVERLAYS)
def test_kubectl_and_python_render_the_same(overlay):
    out = subprocess.run([KUBECTL, "kustomize", str(MANIFESTS / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    by_kubectl = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout) if o}
    by_python = {(o["kind"], o["metadata"]["name"]): o
                 for o in render(MANIFESTS / "overlays" / overlay)}
    assert by_python == by_kubectl


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_every_piece(overlay):
    kinds = {k for k, _ in objects(overlay)}
    assert {"RayCluster", "RayJob", "RayService", "RayCronJob", "ConfigMap", "Service"} <= kinds


# ---- validation ----------------------------------------------------------------------------------------
@needs_crds
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid(overlay):
    for (kind, name), obj in objects(overlay).items():
        assert errors(obj) == [], f"{overlay}: {kind}/{name}"


@needs_crds
def test_rayservice_cluster_is_a_valid_raycluster_spec():
    # Also true without the RayService CRD: the part of a RayService that KubeRay turns into a RayCluster.
    for overlay in OVERLAYS:
        o = objects(overlay)
        svc, rc = o[("RayService", "strata-serve")], o[("RayCluster", "strata")]
        assert svc["spec"]["rayClusterConfig"] == rc["spec"]
        assert crd_errors({**rc, "spec": svc["spec"]["rayClusterConfig"]}) == []


@needs_crds
def test_without_the_rayservice_crd_its_cluster_is_still_checked(monkeypatch):
    monkeypatch.setitem(CRD_FILES, "RayService", "absent.yaml")
    crd_validator.cache_clear()
    try:
        svc = objects("cpu-tiny")[("RayService", "strata-serve")]
        assert crd_errors(svc) == []
        svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "1"
        assert [e for e in crd_errors(svc) if e.startswith("spec.rayClusterConfig.workerGroupSpecs.0.minReplicas")]
    finally:
        crd_validator.cache_clear()


@needs_crds
def test_broken_manifests_fail_validation():
    o = objects("cpu-tiny")
    rc = o[("RayCluster", "strata")]
    bad = copy.deepcopy(rc)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"                  # wrong type
    assert any("replicas" in e and "integer" in e for e in errors(bad))
    bad = copy.deepcopy(rc)
    del bad["spec"]["workerGroupSpecs"][1]["groupName"]                     # missing required field
    assert any("'groupName' is a required property" in e for e in errors(bad))
    bad = copy.deepcopy(rc)
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resource"] = {}   # typo
    assert any("'resource' was unexpected" in e for e in errors(bad))
    job = copy.deepcopy(o[("RayJob", "strata-launch")])
    job["spec"]["entrypont"] = job["spec"].pop("entrypoint")
    assert errors(job)
    cron = copy.deepcopy(o[("RayCronJob", "strata-rebalance")])
    del cron["spec"]["schedule"]
    assert any("'schedule' is a required property" in e for e in errors(cron))
    svc = copy.deepcopy(o[("Service", "strata-http")])
    svc["spec"]["ports"][0]["port"] = "http"
    assert any("ports" in e for e in errors(svc))
    cm = copy.deepcopy(o[("ConfigMap", "strata-config")])
    cm["data"]["cluster.yaml"] = {"engine": {}}                               # data values are strings
    assert errors(cm)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kuberay_operator_rules(overlay):
    for (kind, name), obj in objects(overlay).items():
        if obj["apiVersion"].startswith("ray.io/"):
            assert operator_errors(obj) == [], f"{kind}/{name}"
    o = objects(overlay)
    bad = o[("RayCronJob", "strata-rebalance")]
    bad["spec"]["schedule"] = "every 30 minutes"
    bad["spec"]["jobTemplate"]["clusterSelector"] = {"app": "strata"}
    assert len(operator_errors(bad)) == 2


# ---- the manifests against the code --------------------------------------------------------------------
def cluster_config(overlay: str) -> ClusterConfig:
    return from_text(objects(overlay)[("ConfigMap", "strata-config")]["data"]["cluster.yaml"])


def groups(rc: dict) -> dict[str, dict]:
    return {"head": rc["spec"]["headGroupSpec"], **{g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}}


def mounts(group: dict) -> dict[str, dict]:
    """mountPath -> the volume behind it, for the Ray container of a group."""
    spec = group["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: {**vols[m["name"]], "readOnly": m.get("readOnly", False)}
            for m in spec["containers"][0].get("volumeMounts", [])}


def quantity(q: str | int) -> float:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    return float(m.group(1)) * units.get(m.group(2), 1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmap_cluster_yaml_loads_and_matches_the_pods(overlay):
    cfg = cluster_config(overlay)
    o = objects(overlay)
    rc = o[("RayCluster", "strata")]
    g = groups(rc)
    assert cfg.server.host == "0.0.0.0"
    assert cfg.ray.address == "auto"
    for name, group in g.items():
        # Ray takes the HTTP front from the nodes' environment, not from the YAML: every pod's must match it.
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0].get("env", [])}
        haproxy = cfg.server.front == "haproxy"
        assert env.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == ("1" if haproxy else "0"), name
        assert env.get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == RAY_ENV["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"], name
        if haproxy:
            assert env["RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"] == "actors.lifecycle:haproxy_no_route_is_starting"
            assert env["RAY_SERVE_HAPROXY_METRICS_ENABLED"] == front_env("haproxy")["RAY_SERVE_HAPROXY_METRICS_ENABLED"]
        m = mounts(group)
        assert m[CONFIG_MOUNT]["configMap"]["name"] == "strata-config" and m[CONFIG_MOUNT]["readOnly"], name
        assert m["/dev/shm"]["emptyDir"]["medium"] == "Memory", name
        if cfg.engine.hicache.l3.backend == "file":
            assert cfg.engine.hicache.l3.path in m, f"{name}: the L3 directory is not a volume"
        if cfg.engine.model.startswith("/"):   # a checkpoint: mounted read-only on every pod
            mount = next(p for p in m if cfg.engine.model.startswith(p.rstrip("/") + "/"))
            assert m[mount]["readOnly"] and m[mount]["persistentVolumeClaim"]["readOnly"], name
            claim = m[mount]["persistentVolumeClaim"]["claimName"]
            assert ("PersistentVolumeClaim", claim) in o
    # One worker per pod: the YAML's worker counts are the groups' replicas, and each pod declares the
    # custom resource of its role (workers.role_resources) and the GPUs its worker asks for.
    assert cfg.workers.role_resources and cfg.workers.colocated == 0
    for role in ("prefill", "decode"):
        group = g[role]
        assert getattr(cfg.workers, role) == group["replicas"] <= group["maxReplicas"]
        declared = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert declared == {f"strata_{role}": 1}
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert float(group["rayStartParams"]["num-cpus"]) >= cfg.workers.num_cpus
        assert quantity(res["limits"].get("nvidia.com/gpu", 0)) >= cfg.workers.num_gpus
    if cfg.workers.num_gpus:
        assert cfg.engine.device == "cuda" and cfg.engine.dtype == "bfloat16"
    else:
        assert cfg.engine.device == "cpu"
        assert not any("nvidia.com/gpu" in json.dumps(group) for group in g.values())
    if cfg.engine.hicache.l3.backend == "mooncake":
        host, port = cfg.engine.hicache.l3.mooncake.master_addr.rsplit(":", 1)
        svc = o[("Service", host)]
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]


def _kv_bytes_per_token_layer(overlay: str, cfg: ClusterConfig) -> tuple[int, int, int, float]:
    """(full layers, sliding layers, K+V bytes per token and layer, weight bytes) of the overlay's model."""
    if cfg.engine.model == "strata-tiny":
        from engine.model.config import ModelConfig
        from engine.model.checkpoint import resolve_model_path
        path = resolve_model_path("strata-tiny")
        mc = ModelConfig.from_dir(path)
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return (len(mc.layer_types) - len(mc.sliding_layers), len(mc.sliding_layers),
                2 * mc.num_key_value_heads * mc.head_dim * cfg.engine.torch_dtype.itemsize, weights)
    # gpt-oss-20b (its config.json): 24 layers alternating sliding/full, 8 KV heads of 64; ~21e9 parameters.
    assert "gpt-oss-20b" in cfg.engine.model, cfg.engine.model
    return 12, 12, 2 * 8 * 64 * cfg.engine.torch_dtype.itemsize, 21e9 * cfg.engine.torch_dtype.itemsize


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_memory_is_sized_for_the_l2_pool(overlay):
    """A worker pod's memory request covers its L2 host pool, the L1 pools when they live in host memory
    (CPU), the weights staged on the host, its Mooncake segment, the /dev/shm emptyDir (which counts
    against the pod's memory) and 1 GiB for Ray and Python."""
    cfg = cluster_config(overlay)
    e, h = cfg.engine, cfg.engine.hicache
    full, swa, per_tok, weights = _kv_bytes_per_token_layer(overlay, cfg)
    page = e.page_size * per_tok
    l2 = page * (full * h.host_pages + swa * h.host_swa_pages)
    l1 = page * (full * e.num_pages + swa * e.pool.num_swa_pages)
    segment = (h.l3.mooncake.segment_bytes or h.l3.capacity_bytes) if h.l3.backend == "mooncake" else 0
    rc = objects(overlay)[("RayCluster", "strata")]
    for role in ("prefill", "decode"):
        group = groups(rc)[role]
        res = group["template"]["spec"]["containers"][0]["resources"]
        shm = quantity(mounts(group)["/dev/shm"]["emptyDir"]["sizeLimit"])
        need = l2 + (l1 if e.device == "cpu" else 0) + weights + segment + shm + GiB
        assert quantity(res["requests"]["memory"]) >= need, (role, res, need / GiB)
        assert quantity(res["limits"]["memory"]) >= quantity(res["requests"]["memory"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_jobs_services_and_serve_config_point_at_the_code(overlay):
    cfg = cluster_config(overlay)
    o = objects(overlay)
    rc = o[("RayCluster", "strata")]
    job, cron = o[("RayJob", "strata-launch")], o[("RayCronJob", "strata-rebalance")]
    config_file = f"{CONFIG_MOUNT}/cluster.yaml"
    assert job["spec"]["entrypoint"] == f"python -m cluster.launch --config {config_file} --detach --if-exists replace"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": rc["metadata"]["name"]}
    tmpl = cron["spec"]["jobTemplate"]
    assert tmpl["clusterSelector"] == {"ray.io/cluster": rc["metadata"]["name"]}
    assert tmpl["entrypoint"].split()[:2] == ["strata", "rebalance"] and config_file in tmpl["entrypoint"]
    assert len(cron["spec"]["schedule"].split()) == 5
    # The HTTP Service reaches the ingress of the head and is scraped on the ingress port.
    http = o[("Service", "strata-http")]
    assert http["spec"]["selector"] == {"ray.io/cluster": "strata", "ray.io/node-type": "head"}
    assert [p["targetPort"] for p in http["spec"]["ports"]] == [cfg.server.port]
    head_tmpl = rc["spec"]["headGroupSpec"]["template"]
    svc = o[("RayService", "strata-serve")]
    for ann in (http["metadata"]["annotations"], head_tmpl["metadata"]["annotations"],
                svc["spec"]["serveService"]["metadata"]["annotations"]):
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert ann["prometheus.io/port"] == str(cfg.server.port)
    assert cfg.server.port in [p["containerPort"] for p in head_tmpl["spec"]["containers"][0]["ports"]]
    # The RayService's application: an importable builder, fed the mounted config, on the ingress port.
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert serve_cfg["http_options"]["port"] == cfg.server.port
    (app,) = serve_cfg["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    assert app["args"] == {"config": config_file}
    assert [d["name"] for d in app["deployments"]] == ["ingress"]


def test_image_pins_the_clusters_ray_version():
    docker = (MANIFESTS / "Dockerfile").read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", docker, re.M).group(1)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", docker, re.M)
    for overlay in OVERLAYS:
        assert objects(overlay)[("RayCluster", "strata")]["spec"]["rayVersion"] == ray_version
    import ray
    assert ray.__version__ == ray_version, "the tests ran against another Ray than the image ships"


def test_role_resources_place_each_role_on_its_group():
    cfg = cluster_config("cpu-tiny")
    assert cfg.workers.bundle("prefill") == {"CPU": cfg.workers.num_cpus, "strata_prefill": 1.0}
    assert cfg.workers.role_resource("decode") == {"strata_decode": 1.0}
    with pytest.raises(ValueError, match="workers.role_resources"):
        from_text("workers: {prefill: 1, decode: 1, role_resources: 'yes'}")
    assert from_text("workers: {prefill: 1, decode: 1}").workers.bundle("decode") == {"CPU": 0.5}


def test_unit_helpers_fail_on_unsupported_kustomize(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        render(tmp_path)
    assert math.isclose(quantity("3Gi"), 3 * GiB) and quantity("500m") == 0.5
