"""`strata serve` as a background job stops cleanly on SIGINT and SIGTERM: /health answers 503 "starting"
(never Serve's 404) from the moment the port answers until ready, a running generation finishes, a new
request during the drain gets 503 "shutting down" (or a refused connection once the port is gone), the
process exits 0 without a traceback, and no process of the Ray cluster it started is left.

The cluster lives in its own RAY_TMPDIR, and only processes started under it are stopped if a test fails:
never `ray stop`, which would end every Ray cluster on the machine."""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import asyncio

import httpx
import pytest

from actors.lifecycle import STARTING, NoRouteIsStarting
from cluster.config import from_text
from tests.util import free_port, processes_started_under, stop_processes_started_under

ROOT = Path(__file__).resolve().parents[2]
STRATA = Path(sys.executable).parent / "strata"
LONG = 400           # tokens of the generation that is running when the signal comes (a few seconds)


# ---- without Ray ---------------------------------------------------------------------------------------
def test_config_validates_drain_timeout_and_if_exists():
    cfg = from_text("server: {drain_timeout: 5}\nray: {if_exists: replace}")
    assert cfg.server.drain_timeout == 5 and cfg.ray.if_exists == "replace"
    assert from_text("").ray.if_exists == "adopt" and from_text("").server.drain_timeout == 30
    with pytest.raises(ValueError, match="drain_timeout"):
        from_text("server: {drain_timeout: -1}")
    with pytest.raises(ValueError, match="if_exists"):
        from_text("ray: {if_exists: keep}")


def _through_middleware(status: int, ctype: bytes, body: bytes) -> list:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body})

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(NoRouteIsStarting(app)({"type": "http", "path": "/health"}, None, send))
    return sent


def test_the_proxys_404_for_a_route_it_does_not_know_yet_is_503_starting():
    sent = _through_middleware(404, b"text/plain; charset=utf-8", b"Path '/health' not found.")
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"]) == STARTING and len(sent) == 2
    # The app's own answers, a JSON 404 included, pass unchanged.
    for status, ctype in ((404, b"application/json"), (200, b"text/plain")):
        sent = _through_middleware(status, ctype, b"x")
        assert sent[0]["status"] == status and sent[1]["body"] == b"x"


def test_config_front_is_haproxy_or_serve_proxy():
    assert from_text("").server.front == "haproxy"
    assert from_text("server: {front: serve_proxy}").server.front == "serve_proxy"
    with pytest.raises(ValueError, match="server.front"):
        from_text("server: {front: nginx}")


def test_config_access_log_is_off_unless_asked():
    from cluster.launch import ingress_options
    assert from_text("").server.access_log is False
    on = from_text("server: {access_log: true}").server
    assert on.access_log is True and ingress_options(on)["logging_config"] == {"enable_access_log": True}
    assert ingress_options(from_text("").server)["logging_config"] == {"enable_access_log": False}
    with pytest.raises(ValueError, match="server.access_log"):
        from_text("server: {access_log: 1}")


def test_front_env_gives_each_cluster_its_own_ports_and_files(monkeypatch):
    from cluster import front
    from storage.ports import ephemeral_range
    a, b = front.front_env("haproxy", "/tmp/slcA"), front.front_env("haproxy", "/tmp/slcB")
    assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and a["RAY_SERVE_HAPROXY_SOCKET_PATH"].startswith("/tmp/slcA/")
    assert a["RAY_SERVE_HAPROXY_METRICS_ENABLED"] == "0"     # no metric line per request to Serve's proxy actor
    ports = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")
    assert len({a[k] for k in ports} | {b[k] for k in ports}) == 6
    # Outside the kernel's ephemeral range, where any outgoing connection could take one before HAProxy binds it.
    assert not any(int(env[k]) in ephemeral_range() for env in (a, b) for k in ports)
    # A temp dir too long for HAProxy's socket paths (97 bytes with Ray's per-node directory) falls back.
    assert front.front_env("haproxy", "/tmp/" + "x" * 40)["RAY_SERVE_HAPROXY_SOCKET_PATH"].startswith("/tmp/haproxy-serve/")
    assert front.front_env("serve_proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    # set_front_env replaces what it set before, keeps what the user set, and drops the other front's keys.
    monkeypatch.setattr(front, "_front_keys", set())
    for k in front.front_env("haproxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    front.set_front_env("haproxy", check=False)
    first = os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"]
    front.set_front_env("haproxy", check=False)
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404" and os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] != first
    front.set_front_env("serve_proxy")
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and "RAY_SERVE_HAPROXY_METRICS_PORT" not in os.environ
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"


def test_without_an_haproxy_binary_the_error_names_the_switch():
    # Ray takes the binary from RAY_SERVE_HAPROXY_BINARY_PATH before its bundled one: a path to nothing is
    # a machine without HAProxy. The launch says so in one line, before it starts Ray.
    env = {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": "/nonexistent/haproxy",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-m", "cluster.launch"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "server.front: serve_proxy" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_haproxy_template_reuses_server_connections_safely():
    """Ray's template reuses idle server connections for any request ("always"); a replica that dies with
    a request on such a connection makes HAProxy drop the client's connection without an answer. strata's
    template says "safe" in every backend."""
    from ray.serve._private import haproxy
    from actors.lifecycle import strata_haproxy_template
    assert "http-reuse always" in haproxy.HAPROXY_CONFIG_TEMPLATE   # else this Ray changed what we patch
    out = strata_haproxy_template(haproxy.HAPROXY_CONFIG_TEMPLATE)
    assert "http-reuse always" not in out and out.count("http-reuse safe") == \
        haproxy.HAPROXY_CONFIG_TEMPLATE.count("http-reuse always")


@contextlib.contextmanager
def _ray_haproxy(extra: str = ""):
    """Ray's own HAProxy config, as its HAProxyManager renders it before any application is deployed, from
    strata's template, with ``extra`` sections appended (under the same ``defaults``), run by Ray's HAProxy
    binary. Yields (the config object, HAProxy's HTTP port, the config's directory) once that port answers."""
    from ray.serve._private import haproxy
    from ray.serve.config import HTTPOptions
    from actors.lifecycle import strata_haproxy_template

    port = free_port()
    d = tempfile.mkdtemp(prefix="hap", dir="/tmp")
    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    try:
        haproxy.HAPROXY_CONFIG_TEMPLATE = strata_haproxy_template(template)
        api = haproxy.HAProxyApi(haproxy.HAProxyConfig(
            http_options=HTTPOptions(host="127.0.0.1", port=port), socket_path=f"{d}/admin.sock",
            server_state_base=d, server_state_file=f"{d}/state", metrics_port=free_port(),
            stats_port=free_port(), metrics_socket_path=f"{d}/metrics.sock", metrics_enabled=False,
            is_head=True, has_received_routes=True), config_file_path=f"{d}/haproxy.cfg")
        api._generate_config_file_internal()
    finally:
        haproxy.HAPROXY_CONFIG_TEMPLATE = template
    try:
        with open(f"{d}/haproxy.cfg", "a") as f:
            f.write(extra)
        proc = subprocess.Popen([haproxy.get_haproxy_binary(), "-db", "-f", f"{d}/haproxy.cfg"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/-/healthz", timeout=5)
                    break
                except httpx.TransportError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                    time.sleep(0.1)
            yield api.cfg, port, d
        finally:
            proc.kill()
            proc.wait(10)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_haproxy_answers_starting_for_a_path_no_app_routes():
    """/health (any path) is 503 STARTING in JSON; HAProxy's own /-/healthz is untouched; its side
    listeners (Prometheus, stats) are on loopback too."""
    with _ray_haproxy() as (cfg, port, d):
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert r.status_code == 503 and r.json() == STARTING and r.headers["retry-after"] == "2"
        assert r.headers["content-type"] == "application/json"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json() == STARTING
        hz = httpx.get(f"http://127.0.0.1:{port}/-/healthz", timeout=5)
        assert (hz.status_code, hz.text) == (200, "success")
        conf = open(f"{d}/haproxy.cfg").read()
        assert f"bind 127.0.0.1:{cfg.metrics_port}\n" in conf and f"bind 127.0.0.1:{cfg.stats_port}\n" in conf
        assert httpx.get(f"http://127.0.0.1:{cfg.metrics_port}/metrics", timeout=5).status_code == 200


def test_haproxy_answers_a_replica_lost_mid_request_in_the_api_s_error_shape():
    """HAProxy's own answers when no replica answers, under the ``defaults`` of Ray's template as strata
    rewrites it: a replica that closes the connection with the request in flight (it died) is a 502, a
    backend with no replica to connect to a 503; each JSON in OpenAI's error shape with Retry-After, where
    Ray's template sends a text/plain "500 Internal Server Error" for both."""
    from ray.serve._private import haproxy
    import openai
    from actors.lifecycle import front_error_body, json_front_errors

    assert "500.http" not in json_front_errors(haproxy.HAPROXY_CONFIG_TEMPLATE)
    closer = socket.create_server(("127.0.0.1", 0))   # a replica that dies with each request in flight
    refused = free_port()                               # a replica that is gone

    def close_each():
        while True:
            try:
                c, _ = closer.accept()
            except OSError:
                return
            with c:
                buf = b""
                while b"\r\n\r\n" not in buf and (chunk := c.recv(65536)):
                    buf += chunk
    threading.Thread(target=close_each, daemon=True).start()
    front = free_port()
    extra = f"""
frontend strata_test
    bind 127.0.0.1:{front}
    use_backend gone if {{ path_beg /gone }}
    default_backend dies
backend dies
    server r1 127.0.0.1:{closer.getsockname()[1]}
backend gone
    server r1 127.0.0.1:{refused}
"""
    try:
        with _ray_haproxy(extra):
            for path, status, retry in (("/v1/completions", 502, "1"), ("/gone/generate", 503, "2")):
                r = httpx.post(f"http://127.0.0.1:{front}{path}", json={"prompt": "hi"}, timeout=30)
                assert (r.status_code, r.headers["content-type"], r.headers["retry-after"]) == \
                    (status, "application/json", retry), (r.status_code, r.headers, r.text)
                assert r.json() == front_error_body(status) and r.json()["error"]["code"] == status
            # the official client reads it as the server's error, its message included
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{front}/v1", api_key="-", max_retries=0)
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model="m", prompt="hi", max_tokens=1)
            assert e.value.status_code == 502 and "closed the connection before answering" in e.value.message
    finally:
        closer.close()


def test_signals_raise_while_starting_then_only_count():
    from cluster.lifecycle import Signals, Stopped

    sig = Signals()
    with pytest.raises(Stopped):
        sig._on_signal(signal.SIGTERM, None)
    sig._on_signal(signal.SIGINT, None)     # after the first, nothing raises
    assert sig.received == ["SIGTERM", "SIGINT"] and sig.hurry and sig.wait() == "SIGTERM"


# ---- strata serve in the background ----------------------------------------------------------------------
class Served:
    """A `strata serve` started the way a non-interactive shell starts `strata serve &`: SIGINT ignored."""

    def __init__(self, tmp_path: Path) -> None:
        # Ray's session sockets live under its temp dir: pytest's tmp_path is too long for a Unix socket path.
        self.ray_tmp = tempfile.mkdtemp(prefix="slc", dir="/tmp")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp_path / "serve.yaml"
        text = (ROOT / "cluster/configs/default.yaml").read_text()
        # Its own port and its own L3 directory; the checkpoint comes from the tests' STRATA_HOME.
        cfg.write_text(text.replace("port: 8000", f"port: {self.port}").replace('path: ""', f'path: "{tmp_path}/l3"'))
        env = {**os.environ, "RAY_TMPDIR": self.ray_tmp,
               # Ray's workers import the project from here, not from wherever the venv's install points.
               "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        env.pop("RAY_ADDRESS", None)
        self.stdout: list[str] = []
        self.proc = subprocess.Popen(
            [str(STRATA), "serve", "--config", str(cfg)], env=env, cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.stderr: list[str] = []
        for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def output(self) -> str:
        return "".join(self.stdout) + "\n--- stderr ---\n" + "".join(self.stderr)

    def wait_ready(self, timeout: float = 240.0) -> list:
        """Poll /health until 200 and `strata serve` says it serves; returns what /health answered, in order
        (status, body), from the first answer of the port on."""
        seen, t0 = [], time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, self.output()
            try:
                r = httpx.get(f"{self.url}/health", timeout=10)
                if not seen or seen[-1] != (r.status_code, r.text):
                    seen.append((r.status_code, r.text))
            except httpx.TransportError:
                pass
            if seen and seen[-1][0] == 200 and any("strata: Ray at" in line for line in self.stdout):
                return seen
            time.sleep(0.05)
        raise AssertionError(f"not ready in {timeout}s: {seen}\n{self.output()}")

    def processes(self) -> set[int]:
        return processes_started_under(self.ray_tmp)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        stop_processes_started_under(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    try:
        yield s
    finally:
        s.cleanup()


def stream_in_background(url: str, n: int) -> dict:
    """Start a streamed /generate of ``n`` tokens in a thread; returns a dict the thread fills (status,
    chunks, error) and sets ``first`` once the first chunk arrived."""
    out = {"chunks": [], "first": threading.Event(), "done": threading.Event()}

    def run():
        body = {"input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}}
        try:
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        out["chunks"].append(json.loads(line[6:]))
                        out["first"].set()
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            out["error"] = repr(e)
        finally:
            out["first"].set()
            out["done"].set()

    threading.Thread(target=run, daemon=True).start()
    return out


def new_request_during_drain(url: str, deadline: float) -> tuple:
    """/health until it says draining (or the port is gone), then a new /generate: (health, generate)."""
    health = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            health = (r.status_code, r.json())
            if r.status_code == 503 and r.json().get("status") == "draining":
                break
        except httpx.TransportError as e:
            health = ("refused", repr(e))
            break
        time.sleep(0.05)
    try:
        r = httpx.post(f"{url}/generate", timeout=30,
                       json={"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4}})
        return health, (r.status_code, r.text)
    except httpx.TransportError as e:
        return health, ("refused", repr(e))


def assert_exited_cleanly(s: Served, t_signal: float, bound: float) -> float:
    try:
        rc = s.proc.wait(bound)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {bound}s after the signal\n{s.output()}") from None
    took = time.monotonic() - t_signal
    time.sleep(0.5)     # the reader threads take the last lines
    assert rc == 0, s.output()
    assert "Traceback" not in "".join(s.stderr), s.output()
    assert "strata: stopped" in "".join(s.stderr), s.output()
    assert not s.processes(), (s.processes(), s.output())
    return took


@pytest.mark.slow
def test_sigint_to_a_background_serve_drains_and_stops_cleanly(served):
    s = served
    t0 = time.monotonic()
    seen = s.wait_ready()
    ready_s = time.monotonic() - t0
    # Before ready the port answered only 503 "starting" (the proxy's 404 for an unknown route never shows).
    assert seen[-1][0] == 200 and json.loads(seen[-1][1])["status"] == "ready", seen
    assert all(code == 503 and json.loads(body) == {"ok": False, "status": "starting"} for code, body in seen[:-1]), seen
    assert len(seen) >= 2, f"never saw 503 starting: {seen}"

    gen = stream_in_background(s.url, LONG)
    assert gen["first"].wait(60) and gen["chunks"], gen
    t_signal = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    health, new = new_request_during_drain(s.url, t_signal + 30)
    assert health[0] == "refused" or health == (503, {"ok": False, "status": "draining"}), health
    assert new[0] == "refused" or (new[0] == 503 and "shutting down" in new[1]), new
    assert not gen["done"].is_set() or health[0] != "refused", "the generation was over before the drain"
    assert gen["done"].wait(60), gen
    assert gen.get("status") == 200 and "error" not in gen, gen
    assert len(gen["chunks"][-1]["output_ids"]) == LONG, gen["chunks"][-1]
    took = assert_exited_cleanly(s, t_signal, 90)
    print(f"\nready after {ready_s:.1f}s; exit {took:.1f}s after SIGINT; /health seen: {seen}")


@pytest.mark.slow
def test_sigterm_drains_and_a_second_signal_stops_at_once(served):
    s = served
    s.wait_ready()
    gen = stream_in_background(s.url, 4 * LONG)
    assert gen["first"].wait(60) and gen["chunks"], gen
    t_signal = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    health, new = new_request_during_drain(s.url, t_signal + 30)
    assert health == (503, {"ok": False, "status": "draining"}), health
    assert new[0] == 503 and "shutting down" in new[1], new
    s.proc.send_signal(signal.SIGTERM)      # the second signal: no more waiting for the generation
    took = assert_exited_cleanly(s, t_signal, 60)
    assert gen["done"].wait(30)
    last = gen["chunks"][-1] if gen["chunks"] else {}
    # Cut: the stream broke, or ended with an error event, short of its tokens.
    assert "error" in gen or "error" in last or len(last["output_ids"]) < 4 * LONG, (gen, last)
    assert "again: stopping now" in "".join(s.stderr), s.output()
    print(f"\nexit {took:.1f}s after the first SIGTERM; the stream ended with {str(last)[:300]}; "
          f"{gen.get('error')}")
