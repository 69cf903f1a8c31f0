"""``KVEventsConfig``: whether and where a process publishes its KV events on the field's wire
(publisher.py). One section of the cluster YAML (``kv_events:``), the same for every worker and for the
L3 storage actor; each of them binds its own ports."""
from __future__ import annotations

from dataclasses import dataclass

from storage.kv_events.wire import CPU, ENCODINGS, GPU, TAGGED


@dataclass(frozen=True)
class KVEventsConfig:
    """``host``: the address bound and advertised (in the topic and the endpoints); ``auto`` (the default)
    is this node's IP as Ray knows it (the actor shell resolves it: 127.0.0.1 on a local cluster), so the
    router and other consumers on other nodes reach it. ``port``: the first PUB port tried, ``port_range`` ports from it
    (several publishers share a node: the first free one wins; expose that range); 0 takes any free port
    (the endpoints are still discoverable: ``WorkerActor.kv_events_endpoint()``, the router's status).
    The replay (ROUTER) socket binds ``replay_port_offset`` above the PUB port (1000: where Ray Serve
    LLM's KV-aware router looks). ``encoding``: ``tagged`` maps or ``positional`` arrays (wire.py).
    ``buffer_batches``: the batches kept for replay (older ones are dropped: a consumer further behind
    must resync otherwise). ``send_hwm``: messages ZMQ queues per slow subscriber before it drops.
    ``l1_medium``: the medium L1 is published as. Consumers read ``GPU`` as the engine's device tier and
    ``CPU`` / ``CPU_PINNED`` as host offload (Dynamo's indexer: device vs host blocks), so L1 is ``GPU``
    by default even where the engine's device is the CPU: it is still the tier the engine computes from.
    ``CPU`` names the device literally (a consumer then counts L1 as host)."""

    enabled: bool = True
    host: str = "auto"
    port: int = 0
    port_range: int = 64
    replay_port_offset: int = 1000
    encoding: str = TAGGED
    buffer_batches: int = 10_000
    send_hwm: int = 100_000
    l1_medium: str = GPU

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"kv_events.enabled must be a bool, got {self.enabled!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"kv_events.host must be an address or 'auto', got {self.host!r}")
        for name, lo, hi in (("port", 0, 65535), ("port_range", 1, 65535), ("replay_port_offset", 1, 65535),
                             ("buffer_batches", 1, None), ("send_hwm", 0, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                raise ValueError(f"kv_events.{name} must be an int in [{lo}, {hi or 'inf'}], got {v!r}")
        if self.port and self.port + self.port_range - 1 + self.replay_port_offset > 65535:
            raise ValueError(f"kv_events: port {self.port} + port_range {self.port_range} + replay_port_offset "
                             f"{self.replay_port_offset} runs past 65535")
        if self.l1_medium not in (GPU, CPU):
            raise ValueError(f"kv_events.l1_medium must be {GPU!r} or {CPU!r}, got {self.l1_medium!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv_events.encoding must be one of {ENCODINGS}, got {self.encoding!r}")


__all__ = ["KVEventsConfig"]
