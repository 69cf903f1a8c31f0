"""The RayService's application, deployed the way KubeRay deploys it: the serveConfigV2 of the rendered
cpu-tiny RayService goes to Serve's controller, which imports cluster.serve_app:build in a task on a
real local Ray cluster and serves what it returns. Only the deployment-specific values change: the
config file (the cpu-tiny ConfigMap's YAML with a temp L3 directory), the HTTP port (a free one on
127.0.0.1) and the Ray namespace."""
from __future__ import annotations

import os
import time

import httpx
import yaml

from cluster import launch  # noqa: F401  (sets the Ray environment: loopback, no token auth)
from cluster.config import load_config
from tests.deploy.test_manifests import MANIFESTS
from tests.deploy.kustomize_lite import render
from tests.util import _processes, free_port


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
    # Two ingress replicas, as a RayService may scale them: HAProxy (cluster.front's default front)
    # spreads the connections over both, each serving HTTP itself.
    ingress = next(d for d in serve_cfg["applications"][0]["deployments"] if d["name"] == "ingress")
    ingress["num_replicas"] = 2

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
        # Both replicas up, and requests on fresh connections (HAProxy balances per connection) all served.
        deadline = time.monotonic() + 120
        while serve.status().applications["strata"].deployments["ingress"].replica_states.get("RUNNING") != 2:
            assert time.monotonic() < deadline, serve.status()
            time.sleep(0.5)
        for _ in range(8):
            r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                           json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
        # The front is HAProxy, run with this cluster's config, and it answers the probe KubeRay sends to
        # port 8000 of the pods (GET /-/healthz, expecting "success").
        conf_dir = os.path.dirname(os.environ["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"])
        assert any("haproxy" in cmd and f" {conf_dir}/" in cmd for _, cmd in _processes().values())
        hz = httpx.get(f"http://127.0.0.1:{port}/-/healthz", timeout=10)
        assert hz.status_code == 200 and hz.text == "success", hz.text
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
