"""The ``strata`` command.

    strata serve [--config YAML] [--model PATH]   # local Ray cluster + HTTP on 127.0.0.1:8000
    strata demo [--prompt TEXT ...]    # offline generation through the Engine API
    strata bench [--quick]             # engine throughput table (bench/engine.py)
    strata rebalance [--address ADDR]  # rebalance the experts of a running cluster now (EPLB)
    strata scale --prefill N --decode M [--address ADDR]   # add or drain workers while serving
"""
from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = ("The sliding window keeps", "Multi-turn traffic reuses", "Experts are balanced by")


def _serve(args: argparse.Namespace) -> int:
    """Start a local Ray cluster and serve the configured cluster on HTTP until interrupted."""
    from cluster import launch

    argv = (["--config", args.config] if args.config else []) + (["--address", args.address] if args.address else [])
    argv += (["--model", args.model] if args.model else []) + \
        (["--served-model-name", args.served_model_name] if args.served_model_name else [])
    return launch.main(argv)


def _demo(args: argparse.Namespace) -> int:
    from engine import Engine, SamplingParams

    t = time.perf_counter()
    eng = Engine.from_pretrained(args.model, page_size=16, num_pages=1024)
    mc = eng.model_config
    print(f"strata: loaded {args.model} from {eng.model_path} in {time.perf_counter() - t:.1f}s "
          f"({mc.architecture}: {mc.num_hidden_layers} layers, window {mc.window}, "
          f"{mc.num_local_experts} experts)")
    prompts = args.prompt or list(DEMO_PROMPTS)
    t = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
    dt = time.perf_counter() - t
    for p, o in zip(prompts, outs):
        print(f"\n> {p}\n  tokens {o.token_ids}\n  text   {o.text!r}  ({o.finish_reason})")
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n{n} tokens in {dt:.2f}s." + (" strata-tiny has random weights, so the text is noise; the tokens "
          "are those of transformers' GptOss on the same checkpoint." if args.model == "strata-tiny" else ""))
    return 0


def _bench(args: argparse.Namespace) -> int:
    """bench/ sits above the cluster room: run it as its own module rather than import it."""
    import subprocess

    return subprocess.call([sys.executable, "-m", "bench.engine"] + (["--quick"] if args.quick else []))


def _connect(args: argparse.Namespace):
    """(config, started) after connecting to the running cluster named by --address / RAY_ADDRESS."""
    import os

    from cluster import launch  # noqa: F401  (sets the Ray environment before ray is imported)
    from cluster.config import load_config
    import ray

    cfg = load_config(args.config)
    if ray.is_initialized():
        return cfg, False
    address = args.address or os.environ.get("RAY_ADDRESS") or cfg.ray.address
    if not address:
        raise ValueError("no cluster to talk to: pass --address (the Ray address `strata serve` printed) "
                         "or set RAY_ADDRESS")
    ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=False)
    return cfg, True


def _scale(args: argparse.Namespace) -> int:
    targets = {r: n for r, n in (("prefill", args.prefill), ("decode", args.decode)) if n is not None}
    if not targets and not args.config:
        raise ValueError("say how many: --prefill N and/or --decode M, or --config YAML (its workers section)")
    import ray

    from cluster.scale import scale
    cfg, started = _connect(args)
    if not targets:   # redeploying a changed YAML: its worker counts
        targets = {"prefill": cfg.workers.prefill, "decode": cfg.workers.decode}
    try:
        res = scale(cfg, targets, drain_timeout=args.drain_timeout)
    finally:
        if started:
            ray.shutdown()
    print(f"strata: added {res.added or 'none'}, drained and removed {res.removed or 'none'} "
          f"in {res.seconds:.1f}s")
    return 0


def _rebalance(args: argparse.Namespace) -> int:
    """Ask the running cluster's EPLB rebalancer to rebalance now; print balancedness per layer."""
    import os

    from cluster import launch  # noqa: F401  (sets the Ray environment before ray is imported)
    from cluster.config import load_config
    import ray

    from actors.eplb_actor import ACTOR_NAME
    cfg = load_config(args.config)
    ns = cfg.ray.namespace
    started = False
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or cfg.ray.address
        if not address:
            print("strata: error: no cluster to talk to: pass --address (the Ray address `strata serve` "
                  "printed) or set RAY_ADDRESS", file=sys.stderr)
            return 2
        try:
            ray.init(address=address, namespace=ns, log_to_driver=False)
        except Exception as e:
            print(f"strata: error: cannot connect to a Ray cluster at {address}: {e}", file=sys.stderr)
            return 1
        started = True
    try:
        try:
            actor = ray.get_actor(ACTOR_NAME, namespace=ns)
        except ValueError:
            print(f"strata: error: no EPLB rebalancer ({ACTOR_NAME}) in namespace {ns!r}: is a cluster running "
                  "with engine.eplb set in its config?", file=sys.stderr)
            return 1
        rep = ray.get(actor.trigger.remote(), timeout=args.timeout)
        st = ray.get(actor.status.remote(), timeout=args.timeout)
    finally:
        if started:
            ray.shutdown()
    print(f"{'layer':>5}  {'before':>7}  {'after':>7}")
    for i, (b, a) in enumerate(zip(rep["before"], rep["after"])):
        print(f"{i:>5}  {b:>7.3f}  {a:>7.3f}")
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    print(f"{'mean':>5}  {mean(rep['before']):>7.3f}  {mean(rep['after']):>7.3f}")
    if rep["applied"]:
        print(f"strata: rebalanced {rep['workers']} workers in {rep['seconds'] * 1e3:.1f} ms "
              f"({rep['moved_slots']} slots moved; {st['rebalances']} rebalances so far)")
    else:
        print(f"strata: placement kept: {rep['reason']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="strata", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start a local Ray cluster and serve HTTP (127.0.0.1:8000 by default)")
    s.add_argument("--config", default=None, help="cluster YAML (default: cluster/configs/default.yaml)")
    s.add_argument("--address", default=None, help="an existing Ray cluster instead of a local one")
    s.add_argument("--model", default=None, help="serve this checkpoint directory (config.json + safetensors)")
    s.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    s.set_defaults(fn=_serve)
    d = sub.add_parser("demo", help="offline generation with the Engine API, no cluster")
    d.add_argument("--model", default="strata-tiny")
    d.add_argument("--prompt", action="append")
    d.add_argument("--max-new-tokens", type=int, default=24)
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="engine throughput table")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(fn=_bench)
    r = sub.add_parser("rebalance", help="rebalance the experts of a running cluster now (EPLB)")
    r.add_argument("--config", default=None, help="the cluster's YAML (for its Ray namespace)")
    r.add_argument("--address", default=None, help="Ray address of the cluster (default: RAY_ADDRESS)")
    r.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the rebalance")
    r.set_defaults(fn=_rebalance)
    c = sub.add_parser("scale", help="add or drain prefill/decode workers of a running cluster")
    c.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    c.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    c.add_argument("--config", default=None,
                   help="the cluster's YAML (namespace, placement); without --prefill/--decode, its worker counts")
    c.add_argument("--address", default=None, help="Ray address of the cluster (default: RAY_ADDRESS)")
    c.add_argument("--drain-timeout", type=float, default=120.0, help="seconds a removed worker may drain")
    c.set_defaults(fn=_scale)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
