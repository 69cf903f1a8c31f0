"""The Ray Serve application builder of the RayService (manifests/base/rayservice.yaml):

    serveConfigV2:
      applications:
        - name: strata
          import_path: cluster.serve_app:build
          args: {config: /etc/strata/cluster.yaml}

Serve calls ``build(args)`` in a task on the cluster every time the application is (re)deployed. It
loads the cluster YAML, starts the router and the workers as named, detached actors (reused when they
already exist: a redeploy must not start a second set), and returns the bound HTTP ingress, which Serve
runs behind the HTTP front its nodes were started with (HAProxy in front of the replica's own HTTP
server, or Serve's proxy: the pods' env, see manifests/; host and port come from the serve config's
``http_options``, not from the YAML's ``server`` block).
"""
from __future__ import annotations

import os

from cluster import launch  # sets the Ray environment on import
from cluster.config import load_config
from actors.ingress import Ingress


class CheckedIngress(Ingress):
    """The ingress with a Serve health check that applies /health's rule (the router answers and at
    least one worker reported recently): Serve restarts a replica that fails it and the RayService marks
    the application unhealthy, which a kubelet probe cannot do without deadlocking KubeRay (it waits for
    the head pod to be Ready before it deploys the application that would answer /health)."""

    async def check_health(self) -> None:
        h = await self.backend.health()
        if not h.get("ok"):
            raise RuntimeError(f"strata unhealthy: {h}")


def build(args: dict):
    """``args``: ``config`` (the cluster YAML; default ``$STRATA_CONFIG``, else the embedded default)
    and ``ready_timeout`` (seconds to wait for the workers to report, default 600: a large checkpoint
    loads slowly)."""
    args = dict(args or {})
    unknown = sorted(set(args) - {"config", "ready_timeout"})
    if unknown:
        raise ValueError(f"serve_app args: unknown keys {unknown}")
    cfg = load_config(args.get("config") or os.environ.get("STRATA_CONFIG") or None)
    launch.init_ray(cfg)
    # Detached: the builder's task ends once the app is built, and actors it owned would die with it.
    handles = launch.start_actors(cfg, detached=True, get_if_exists=True,
                                  ready_timeout=float(args.get("ready_timeout", 600)))
    return launch.ingress_app(cfg, handles, ingress_cls=CheckedIngress)
