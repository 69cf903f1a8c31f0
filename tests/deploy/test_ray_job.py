"""The deployment path: `ray start --head` on 127.0.0.1, then `ray job submit` of the launch entrypoint,
then a request over HTTP. The cluster it starts lives in its own --temp-dir with its own ports, and only
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

from cluster.launch import RAY_ENV
from tests.util import free_port, processes_started_under, stop_processes_started_under

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_ray_job_submit_serves_a_request(tmp_path):
    # Ray's session sockets live under --temp-dir: pytest's tmp_path is too long for a Unix socket path.
    ray_tmp = tempfile.mkdtemp(prefix="srj", dir="/tmp")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, http, agent, client = free_port(), free_port(), free_port(), free_port(), free_port()
    cfg = tmp_path / "job.yaml"
    cfg.write_text((ROOT / "cluster/configs/default.yaml").read_text().replace("port: 8000", f"port: {http}"))
    subprocess.run([bin_dir / "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                    f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=8",
                    f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
                    "--disable-usage-stats", f"--temp-dir={ray_tmp}"], env=env, check=True, timeout=180,
                   capture_output=True)
    try:
        job = subprocess.run(
            [bin_dir / "ray", "job", "submit", f"--address=http://127.0.0.1:{dash}", f"--working-dir={ROOT}",
             "--", sys.executable, "-m", "cluster.launch", "--config", str(cfg), "--detach"],
            env=env, timeout=300, capture_output=True, text=True, cwd=ROOT)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert f"serving strata-tiny at http://127.0.0.1:{http}" in job.stdout
        deadline = time.time() + 60
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{http}/generate", timeout=30,
                               json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
                break
            except httpx.TransportError:
                if time.time() > deadline:
                    raise
                time.sleep(1)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    finally:
        stop_processes_started_under(ray_tmp, f"127.0.0.1:{gcs} ")
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not processes_started_under(ray_tmp, f"127.0.0.1:{gcs} ")
