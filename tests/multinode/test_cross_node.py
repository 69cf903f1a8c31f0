"""The CI variant of the multi-node tests: pd-2p1d on a 3-node local Ray cluster, one worker per node.
Prefill and decode run on different raylets (the KV crosses Ray's object manager), and a conversation
continued on the other prefill worker gets its prefix from the shared L3, with tokens equal to
Engine.generate."""
import time

import httpx
import pytest
import ray

from engine import Engine, SamplingParams
from tests import numerics
from tests.multinode.load import Load, routes


@pytest.fixture(scope="module")
def reference(mn):
    return Engine.from_pretrained(mn["model_path"], page_size=16, num_pages=512)


def _gen(url, ids, n=8):
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n,
                                                                                  "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _want(eng, ids, n=8):
    return eng.generate([ids], SamplingParams(max_new_tokens=n, return_logits=True))[0]


def test_every_worker_runs_on_its_own_node(mn):
    where = ray.get([w.node.remote() for w in mn["workers"].values()], timeout=60)
    assert len(set(where)) == 3, where
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(where) <= alive and len(alive) == 3


@pytest.mark.numerics
def test_pd_across_nodes_equals_engine_generate(mn, reference):
    mc = reference.model_config
    for ids in ([5, 6, 7], list(range(90)), [i % 256 for i in range(3, 300)]):
        r = _gen(mn["url"], ids)
        route = r["meta_info"]["route"]
        assert route["decode"] and route["prefill"] != route["decode"]
        numerics.assert_same_output(r["output_ids"], _want(reference, ids), mc, f"cross-node pd {len(ids)}")


@pytest.mark.numerics
def test_a_conversation_moved_to_the_other_prefill_node_hits_l3(mn, reference):
    url, router = mn["url"], mn["router"]
    hist = [(i * 17) % 251 for i in range(520)]
    r1 = _gen(url, hist)
    p1 = r1["meta_info"]["route"]["prefill"]
    time.sleep(1.0)      # write-through to L3 runs in the background; its events reach the router
    ray.get(router.remove_worker.remote(p1))
    try:
        turn2 = hist + r1["output_ids"] + [3] * 40
        r2 = _gen(url, turn2)
        assert r2["meta_info"]["route"]["prefill"] != p1
        by_tier = r2["meta_info"]["cached_tokens_by_tier"]
        assert by_tier["L3"] >= 16 * (len(hist) // 16) - 32, by_tier
        numerics.assert_same_output(r2["output_ids"], _want(reference, turn2), reference.model_config, "L3 turn 2")
    finally:
        ray.get(router.restore_worker.remote(p1))


def test_scale_out_then_in_while_serving_fails_no_request(mn, reference):
    """Clients keep sending while prefill goes 2 -> 3 and decode 1 -> 2, then back: every request
    succeeds with the reference tokens, the new workers take traffic, the drained ones are gone."""
    from cluster.scale import scale
    prompts = [[(i * k) % 251 for i in range(40 + 37 * k)] for k in range(1, 5)]
    want = {tuple(p): _want(reference, p, 6) for p in prompts}
    load = Load(mn["url"], prompts)
    try:
        out = scale(mn["cfg"], {"prefill": 3, "decode": 2})
        assert sorted(out.added) == ["decode-1", "prefill-2"] and not out.removed
        n_before = len(load.results)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not {"prefill-2", "decode-1"} <= routes(load.results[n_before:]):
            time.sleep(0.5)
        assert {"prefill-2", "decode-1"} <= routes(load.results[n_before:])
        back = scale(mn["cfg"], {"prefill": 2, "decode": 1})
        assert sorted(back.removed) == ["decode-1", "prefill-2"] and not back.added
        n_after = len(load.results)
        time.sleep(3)
    finally:
        results = load.stop()
    failed = [(len(r.ids), r.status, r.body) for r in results if r.status != 200]
    assert not failed, failed[:3]
    assert len(results) > n_after
    for r in results:
        numerics.assert_same_output(r.body["output_ids"], want[tuple(r.ids)], reference.model_config, "during scaling")
    assert not {"prefill-2", "decode-1"} & routes(results[n_after + 3:])
    st = ray.get(mn["router"].status.remote())
    assert set(st["workers"]) == {"prefill-0", "prefill-1", "decode-0"}
    for w in ("prefill-2", "decode-1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"strata-{w}", namespace=mn["cfg"].ray.namespace)

