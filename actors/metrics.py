"""Prometheus text exposition without a client library: counters, histograms and gauges."""
from __future__ import annotations

import bisect
from collections import defaultdict

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], float] = defaultdict(float)
        self.hist: dict[str, list] = {}

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        self.counters[(name, _labels(labels))] += value

    def observe(self, name: str, value: float) -> None:
        h = self.hist.setdefault(name, [[0] * (len(BUCKETS) + 1), 0.0, 0])
        h[0][bisect.bisect_left(BUCKETS, value)] += 1
        h[1] += value
        h[2] += 1

    def render(self, gauges: dict | None = None) -> str:
        out: list[str] = []
        seen = set()
        for (name, lab), v in sorted(self.counters.items()):
            if name not in seen:
                out.append(f"# TYPE {name} counter")
                seen.add(name)
            out.append(f"{name}{lab} {v}")
        for name, (counts, total, n) in sorted(self.hist.items()):
            out.append(f"# TYPE {name} histogram")
            acc = 0
            for b, c in zip(BUCKETS, counts):
                acc += c
                out.append(f'{name}_bucket{{le="{b}"}} {acc}')
            out.append(f'{name}_bucket{{le="+Inf"}} {n}')
            out.append(f"{name}_sum {total}")
            out.append(f"{name}_count {n}")
        for key, v in sorted((gauges or {}).items()):
            name, _, lab = key.partition("|")
            if name not in seen:
                out.append(f"# TYPE {name} gauge")
                seen.add(name)
            out.append(f"{name}{lab} {v}")
        return "\n".join(out) + "\n"
