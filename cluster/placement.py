"""Where each actor of the cluster runs: the placement section of the YAML and the pure policy that picks
a node for a new worker.

    placement:
      strategy: spread          # pack | spread | strict_spread
      prefill: {resources: {}}  # custom resources (node labels) a prefill worker needs on its node
      decode: {resources: {}}
      router: {resources: {}}   # default: the node that launched the cluster (the head under ray job submit)
      storage: {resources: {}}

``spread`` (the default) puts each new worker on the live node that holds the fewest strata workers, so
one node gets them all and three nodes get one each; the choice is a *soft* node affinity, so a worker
restarted after its node died lands on a surviving node. ``strict_spread`` is the same but refuses to
place two workers on one node (an error names the shortfall) and pins them hard. ``pack`` leaves the
choice to Ray's default scheduler (fills one node first). Roles' resources restrict the candidate nodes
in every strategy (e.g. GPU node groups declaring ``strata_prefill``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

STRATEGIES = ("pack", "spread", "strict_spread")
ROLES = ("prefill", "decode", "colocated", "router", "storage")


def _resources(v, path: str) -> dict[str, float]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"{path} must be a mapping of resource name to amount, got {v!r}")
    out = {}
    for k, n in v.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"{path}: resource names must be non-empty strings, got {k!r}")
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n <= 0:
            raise ValueError(f"{path}.{k} must be a positive number, got {n!r}")
        out[k] = float(n)
    return out


@dataclass(frozen=True)
class RolePlacement:
    resources: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", _resources(self.resources, "placement.<role>.resources"))


@dataclass(frozen=True)
class PlacementConfig:
    strategy: str = "spread"
    prefill: RolePlacement = field(default_factory=RolePlacement)
    decode: RolePlacement = field(default_factory=RolePlacement)
    colocated: RolePlacement = field(default_factory=RolePlacement)
    router: RolePlacement = field(default_factory=RolePlacement)
    storage: RolePlacement = field(default_factory=RolePlacement)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for r in ROLES:
            if not isinstance(getattr(self, r), RolePlacement):
                raise ValueError(f"placement.{r} must be a mapping like {{resources: {{...}}}}")

    def resources(self, role: str) -> dict[str, float]:
        return dict(getattr(self, role).resources)


class NodeInfo(NamedTuple):
    node_id: str
    alive: bool
    resources: dict          # the node's total resources (custom labels included)
    is_head: bool = False


def feasible(node: NodeInfo, need: Mapping[str, float]) -> bool:
    return node.alive and all(node.resources.get(k, 0.0) >= v for k, v in need.items())


def choose_node(nodes: Sequence[NodeInfo], workers_on: Mapping[str, int], need: Mapping[str, float],
                strategy: str) -> str | None:
    """The node a new worker goes to: None means "let Ray decide" (``pack``). ``workers_on``: node id ->
    strata workers already there. Ties go to the node listed first (callers list the head first), so
    the choice is deterministic. Raises ValueError when no live node offers ``need``, or for
    ``strict_spread`` when every such node already holds a worker."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "pack":
        return None
    cands = [n for n in nodes if feasible(n, need)]
    if not cands:
        raise ValueError(f"placement: no live node offers {dict(need)} "
                         f"({sum(n.alive for n in nodes)} live nodes)")
    if strategy == "strict_spread":
        cands = [n for n in cands if workers_on.get(n.node_id, 0) == 0]
        if not cands:
            raise ValueError("placement.strategy strict_spread: every live node already holds a worker; "
                             "add nodes or use spread")
    order = {n.node_id: i for i, n in enumerate(nodes)}
    return min(cands, key=lambda n: (workers_on.get(n.node_id, 0), order[n.node_id])).node_id


def plan(nodes: Sequence[NodeInfo], roles: Sequence[str], cfg: PlacementConfig,
         workers_on: Mapping[str, int] | None = None) -> list[str | None]:
    """``choose_node`` for each of ``roles`` in turn, counting the earlier choices."""
    counts = dict(workers_on or {})
    out = []
    for role in roles:
        node = choose_node(nodes, counts, cfg.resources(role), cfg.strategy)
        if node is not None:
            counts[node] = counts.get(node, 0) + 1
        out.append(node)
    return out
