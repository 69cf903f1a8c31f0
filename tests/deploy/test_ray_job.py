"""The deployment path: `ray start --head` on 127.0.0.1, then `ray job submit` of the launch entrypoint,
then a request over HTTP; then the same job again (adopt), replace and fail, as a re-applied RayJob
would. The cluster it starts lives in its own --temp-dir with its own ports, and only
the processes started under that directory are stopped afterwards: never `ray stop`, which would end
every Ray cluster on the machine (a user's `make run` included)."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from cluster.front import front_env
from cluster.launch import RAY_ENV
from tests.util import free_port, processes_started_under, stop_processes_started_under

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_ray_job_submit_serves_a_request_and_reruns_adopt_or_replace(tmp_path):
    # Ray's session sockets live under --temp-dir: pytest's tmp_path is too long for a Unix socket path.
    ray_tmp = tempfile.mkdtemp(prefix="srj", dir="/tmp")
    bin_dir = Path(sys.executable).parent
    # PYTHONPATH: the cluster's own processes (Serve's proxy imports actors.lifecycle's middleware) take
    # this checkout, not whichever one the venv's editable install points at.
    # front_env: the nodes of a cluster started with `ray start` take the HTTP front from their environment
    # (HAProxy, with this cluster's own ports and files).
    env = {**os.environ, **RAY_ENV, **front_env("haproxy", ray_tmp), "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, http, agent, client = free_port(), free_port(), free_port(), free_port(), free_port()
    cfg = tmp_path / "job.yaml"
    cfg.write_text((ROOT / "cluster/configs/default.yaml").read_text().replace("port: 8000", f"port: {http}"))
    subprocess.run([bin_dir / "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                    f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=8",
                    f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
                    "--disable-usage-stats", f"--temp-dir={ray_tmp}"], env=env, check=True, timeout=180,
                   capture_output=True)

    def submit(*flags: str) -> str:
        t = time.monotonic()
        job = subprocess.run(
            [bin_dir / "ray", "job", "submit", f"--address=http://127.0.0.1:{dash}", f"--working-dir={ROOT}",
             "--", sys.executable, "-m", "cluster.launch", "--config", str(cfg), "--detach", *flags],
            env=env, timeout=300, capture_output=True, text=True, cwd=ROOT)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert f"serving strata-tiny at http://127.0.0.1:{http}" in job.stdout, job.stdout[-3000:]
        said = [ln for ln in job.stdout.splitlines() if ln.startswith("strata:")]
        print(f"\njob {' '.join(flags) or '(first)'}: {time.monotonic() - t:.1f}s: {said}")
        return job.stdout

    def serves_a_request() -> None:
        deadline = time.time() + 60
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{http}/generate", timeout=30,
                               json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
                if r.status_code != 503:    # 503 "starting" until the ingress is up
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise AssertionError("no answer in 60 s")
            time.sleep(1)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text

    try:
        submit()
        serves_a_request()
        # Conditional disaggregation on 1P+1D, while the router's answers are the only choice: a repeat of a
        # handed-off prompt is prefilled on the decode worker, which holds it (README "How a request flows").
        url, repeat = f"http://127.0.0.1:{http}/generate", {"input_ids": [i % 251 for i in range(200)],
                                                           "sampling_params": {"max_new_tokens": 4}}
        first = httpx.post(url, json=repeat, timeout=30).json()["meta_info"]["route"]
        time.sleep(0.5)   # the decode worker's KV events reach the router within a report interval
        again = httpx.post(url, json=repeat, timeout=30).json()
        assert first["decode"] is not None and again["meta_info"]["route"]["prefill"] == first["decode"], again
        assert len(again["output_ids"]) == 4
        # Re-submitting the same job (a KubeRay retry, a re-apply) adopts the running cluster, app included.
        out = submit("--if-exists", "adopt")
        assert "adopted the running cluster" in out, out[-3000:]
        serves_a_request()
        # replace drains and tears down the old actors, placement group and app, and deploys anew.
        out = submit("--if-exists", "replace")
        assert "replaced the running cluster" in out and "strata-router" in out, out[-3000:]
        serves_a_request()
        # fail refuses to touch a running cluster.
        job = subprocess.run(
            [bin_dir / "ray", "job", "submit", f"--address=http://127.0.0.1:{dash}", f"--working-dir={ROOT}",
             "--", sys.executable, "-m", "cluster.launch", "--config", str(cfg), "--detach", "--if-exists", "fail"],
            env=env, timeout=300, capture_output=True, text=True, cwd=ROOT)
        assert job.returncode != 0 and "already runs in namespace" in job.stdout + job.stderr, job.stdout[-3000:]
        serves_a_request()
    finally:
        stop_processes_started_under(ray_tmp, f"127.0.0.1:{gcs} ")
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not processes_started_under(ray_tmp, f"127.0.0.1:{gcs} ")
