"""The deployment path: `ray start --head` on 127.0.0.1, then `ray job submit` of the launch entrypoint,
then a request over HTTP. It lives apart from tests/e2e because `ray stop` ends every Ray process on the
machine, so it must never overlap the e2e package's cluster."""
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
from tests.util import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_ray_job_submit_serves_a_request(tmp_path):
    # Ray's session sockets live under --temp-dir: pytest's tmp_path is too long for a Unix socket path.
    ray_tmp = tempfile.mkdtemp(prefix="srj", dir="/tmp")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, http = free_port(), free_port(), free_port()
    cfg = tmp_path / "job.yaml"
    cfg.write_text((ROOT / "cluster/configs/default.yaml").read_text().replace("port: 8000", f"port: {http}"))
    subprocess.run([bin_dir / "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                    f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=8",
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
        subprocess.run([bin_dir / "ray", "stop", "--force"], env=env, timeout=120, capture_output=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
