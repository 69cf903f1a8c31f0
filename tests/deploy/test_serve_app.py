"""The RayService's application, deployed the way KubeRay deploys it: the serveConfigV2 of the rendered
cpu-tiny RayService goes to Serve's controller, which imports cluster.serve_app:build in a task on a
real local Ray cluster and serves what it returns. Only the deployment-specific values change: the
config file (the cpu-tiny ConfigMap's YAML with a temp L3 directory), the HTTP port (a free one on
127.0.0.1) and the Ray namespace."""
from __future__ import annotations

import time

import httpx
import yaml

from cluster import launch  # noqa: F401  (sets the Ray environment: loopback, no token auth)
from cluster.config import load_config
from tests.deploy.test_manifests import MANIFESTS
from tests.deploy.kustomize_lite import render
from tests.util import free_port


def _get(url: str, deadline: float) -> httpx.Response:
    while True:
        try:
            r = httpx.get(url, timeout=30)
            if r.status_code == 200 or time.monotonic() > deadline:
                return r
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def test_rayservice_application_serves_health_and_models(tmp_path):
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    objs = {(o["kind"], o["metadata"]["name"]): o for o in render(MANIFESTS / "overlays" / "cpu-tiny")}
    data = yaml.safe_load(objs[("ConfigMap", "strata-config")]["data"]["cluster.yaml"])
    data["engine"]["hicache"]["l3"]["path"] = str(tmp_path / "l3")
    data["ray"] = {"namespace": "strata-serve-app-test"}      # no address: this test's local cluster
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(yaml.safe_dump(data))
    cfg = load_config(config_file)
    port = free_port()
    serve_cfg = yaml.safe_load(objs[("RayService", "strata-serve")]["spec"]["serveConfigV2"])
    serve_cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    serve_cfg["applications"][0]["args"]["config"] = str(config_file)

    # As cluster/launch.py init_ray starts a local cluster, plus the custom resources the prefill and
    # decode pods declare (workers.role_resources is on in the manifests).
    launch.start_local_ray(num_cpus=8, namespace=cfg.ray.namespace,
                           resources={"strata_prefill": 1, "strata_decode": 1})
    try:
        serve.start(http_options=serve_cfg["http_options"])
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(serve_cfg)
                                         if hasattr(ServeDeploySchema, "model_validate")
                                         else ServeDeploySchema.parse_obj(serve_cfg))
        deadline = time.monotonic() + 240
        health = _get(f"http://127.0.0.1:{port}/health", deadline)
        assert health.status_code == 200, (health.status_code, health.text, serve.status())
        assert sorted(health.json()["workers"]) == ["decode-0", "prefill-0"]
        models = _get(f"http://127.0.0.1:{port}/v1/models", deadline)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == [cfg.server.model_name]
        # The workers are the named, detached actors of the configured namespace, each on the node
        # resource of its role.
        for wid in ("prefill-0", "decode-0"):
            assert ray.get(ray.get_actor(f"strata-{wid}", namespace=cfg.ray.namespace).ping.remote()) == wid
        # So is the L3 storage actor (the builder runs in Serve's namespace: a redeploy must find it).
        storage = ray.get_actor("strata-storage", namespace=cfg.ray.namespace)
        assert ray.get(storage.status.remote(), timeout=60)
        assert ray.available_resources().get("strata_prefill", 0) == 0
        # The health check Serve runs on the ingress replica passes (it raises when /health's rule fails).
        assert serve.get_app_handle("strata").check_health.remote().result(timeout_s=60) is None
        app = serve.status().applications["strata"]
        assert app.status == "RUNNING", app
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
