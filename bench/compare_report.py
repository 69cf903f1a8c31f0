"""The table, the expected outcomes and the plots of bench/compare.py (pure over its results)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

MB = 1 << 20


def _rounds(res: dict) -> dict[int, dict]:
    return {p["round"]: p for p in res["summary"]["per_round"]}


def later_rounds(res: dict, key: str) -> list[float]:
    return [p[key] for n, p in sorted(_rounds(res).items()) if n >= 2]


def row_of(res: dict, num_rounds: int) -> dict:
    s, per = res["summary"], _rounds(res)
    row = {"config": res["name"]}
    for i in range(1, num_rounds + 1):
        row[f"hit r{i}"] = round(per[i]["hit_rate"], 3) if i in per else None
    r2 = later_rounds(res, "ttft_mean_s")
    row.update({
        "ttft ms": 1e3 * s["ttft_s"]["mean"],
        "ttft r2+ ms": 1e3 * statistics.fmean(r2) if r2 else None,
        "itl ms": 1e3 * s["itl_s"]["mean"],
        "in tok/s": s["input_tokens_per_s"],
        "host KB/conv": res["host_bytes_per_conversation"] / 1024,
        "L1->L2 MB": res["bytes_moved"]["L1->L2"] / MB,
        "L2->L1 MB": res["bytes_moved"]["L2->L1"] / MB,
        "L3 MB": res["bytes_moved"]["L2->L3 (stored)"] / MB,
        "hit tok L1/L2/L3": "/".join(str(res["hit_tokens_by_tier"][t]) for t in ("L1", "L2", "L3")),
        "errors": s["errors"],
    })
    return row


def _by_name(results: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in results}


def checks(results: list[dict], factor: dict) -> list[dict]:
    """The outcomes the benchmark is meant to show, each with what was measured."""
    by = _by_name(results)
    out = []

    def add(claim: str, ok: bool, detail: str) -> None:
        out.append({"claim": claim, "ok": bool(ok), "detail": detail})

    for name in ("L1+L2", "L1+L2+L3"):
        if name in by:
            hits = later_rounds(by[name], "hit_rate")
            add(f"{name}: hit rate >= 0.8 from round 2", hits and min(hits) >= 0.8,
                "rounds 2+: " + ", ".join(f"{h:.3f}" for h in hits))
    if "no cache" in by:
        base = statistics.fmean(later_rounds(by["no cache"], "ttft_mean_s"))
        for name in ("L1+L2", "L1+L2+L3"):
            if name in by:
                t = statistics.fmean(later_rounds(by[name], "ttft_mean_s"))
                add(f"{name}: TTFT (rounds 2+) below no cache", t < base,
                    f"{1e3 * t:.0f} ms vs {1e3 * base:.0f} ms (x{base / t:.2f})")
    if "2P prefix router" in by and "2P round-robin" in by:
        p = statistics.fmean(later_rounds(by["2P prefix router"], "hit_rate"))
        r = statistics.fmean(later_rounds(by["2P round-robin"], "hit_rate"))
        add("2 prefill workers: prefix router beats round-robin on hit rate (rounds 2+)", p > r,
            f"{p:.3f} vs {r:.3f}")
    if "L1+L2" in by and "L1+L2 SWA-oblivious" in by:
        a = by["L1+L2"]["host_bytes_per_conversation"]
        o = by["L1+L2 SWA-oblivious"]["host_bytes_per_conversation"]
        ratio = a / o if o else math.nan
        lo, hi = factor["one_window"], factor["one_window_per_round"]
        add("SWA-aware host bytes per conversation below SWA-oblivious by the offline factor",
            a < o and ratio <= hi * 1.05,
            f"{a / 1024:.0f} KB vs {o / 1024:.0f} KB: x{ratio:.3f} (bound of bench/multiturn_offline for "
            f"{factor['tokens_per_conversation']} tokens: x{lo:.3f} with one window kept, x{hi:.3f} with one "
            f"per round)")
    return out


def plot_all(results: list[dict], num_rounds: int, out_dir: Path) -> list[Path]:
    """compare_hit_rate.png, compare_ttft.png, compare_host_bytes.png, compare_bytes_moved.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rounds = list(range(1, num_rounds + 1))

    def per_round_plot(key: str, scale: float, ylabel: str, fname: str, title: str) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, r in enumerate(results):  # markers and dashes differ: equal curves must stay visible
            per = _rounds(r)
            ax.plot([n for n in rounds if n in per], [scale * per[n][key] for n in rounds if n in per],
                    marker="osD^vP*X"[i % 8], linestyle=("-", "--", ":", "-.")[i % 4], markersize=9 - i % 4,
                    label=r["name"])
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_xticks(rounds)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    per_round_plot("hit_rate", 1.0, "cache hit rate (cached / prompt tokens)", "compare_hit_rate.png",
                   "Prefix cache hit rate per round")
    per_round_plot("ttft_mean_s", 1e3, "mean TTFT (ms)", "compare_ttft.png",
                   "Time to first token per round (shared 2-core CPU: relative)")

    names = [r["name"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    full = [(r["host_bytes_per_conversation"] - r["host_swa_bytes_per_conversation"]) / 1024 for r in results]
    swa = [r["host_swa_bytes_per_conversation"] / 1024 for r in results]
    ax.barh(names, full, label="full-attention layers")
    ax.barh(names, swa, left=full, label="sliding-window layers")
    ax.set_xlabel("host (L2) KB per conversation, all workers")
    ax.set_title("Host memory per conversation")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "compare_host_bytes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = ["L1->L2", "L2->L1", "L2->L3 (stored)"]
    h = 0.8 / len(kinds)
    for i, k in enumerate(kinds):
        ax.barh([j + i * h for j in range(len(names))], [r["bytes_moved"][k] / MB for r in results], height=h,
                label=k)
    ax.set_yticks([j + h for j in range(len(names))])
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("MB moved over the whole run, all workers")
    ax.set_title("Bytes moved per tier")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "compare_bytes_moved.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


README_BEGIN, README_END = "<!-- bench.compare:begin -->", "<!-- bench.compare:end -->"


def markdown(rows: list[dict], cols: list[str], outcome: list[dict], note: str) -> str:
    """The table and the expected outcomes as Markdown (for the README's Results section)."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return "" if v is None else str(v)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    out += ["", note, ""]
    out += [f"- {'✅' if c['ok'] else '❌'} {c['claim']}: {c['detail']}" for c in outcome]
    return "\n".join(out)


def update_readme(readme: Path, body: str) -> bool:
    """Replace what lies between the bench.compare markers of the README; False when it has none."""
    text = readme.read_text()
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        return False
    readme.write_text(text[:i + len(README_BEGIN)] + "\n" + body + "\n" + text[j:])
    return True
