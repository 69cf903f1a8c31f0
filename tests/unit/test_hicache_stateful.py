"""Hypothesis drives the engine + HiCache controller with random request arrivals, steps, aborts,
evictions, waits on background copies and flushes over tight pools; integrity is checked after every
rule, finished requests must carry the no-cache engine's tokens, and nothing may leak."""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine import Engine, SamplingParams
from engine.model.loader import random_state_dict, save_checkpoint, tiny_config
from storage.config import HiCacheConfig
from tests import numerics

MICRO = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             layer_types=("sliding_attention", "full_attention"))
PS = 4
SP = SamplingParams(max_new_tokens=3, ignore_eos=True)
SP_REF = SamplingParams(max_new_tokens=3, ignore_eos=True, return_logits=True)
EXAMPLES = int(os.environ.get("STRATA_STATEFUL_EXAMPLES", "400"))


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory):
    cfg = tiny_config(**MICRO)
    path = tmp_path_factory.mktemp("micro")
    save_checkpoint(path, cfg, random_state_dict(cfg, seed=3))
    return str(path)


@pytest.mark.numerics
def test_controller_state_machine(micro_ckpt):
    ref = Engine.from_pretrained(micro_ckpt, page_size=PS, num_pages=256)
    ref_tokens: dict = {}
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(4)]

    def want(prompt: list[int]):
        key = tuple(prompt)
        if key not in ref_tokens:
            ref_tokens[key] = ref.generate([prompt], SP_REF)[0]
        return ref_tokens[key]

    class Machine(RuleBasedStateMachine):
        @initialize(policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                    layout=st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
                    l1_pages=st.integers(14, 40), host_pages=st.integers(6, 40),
                    eviction=st.sampled_from(["lru", "slru"]))
        def setup(self, policy, layout, l1_pages, host_pages, eviction):
            self.eng = Engine.from_pretrained(
                micro_ckpt, page_size=PS, num_pages=l1_pages, swa_full_ratio=0.5, max_batch_tokens=16,
                max_running_requests=3, enable_prefix_cache=True, poison_kv=True, prefix_eviction=eviction,
                hicache=HiCacheConfig(host_pages=host_pages, write_policy=policy, layout=layout,
                                      write_through_threshold=2, host_swa_ratio=0.5))
            self.live: dict[str, list[int]] = {}

        @rule(conv=st.integers(0, 3), cut=st.integers(1, 40), extra=st.integers(0, 6))
        def add(self, conv, cut, extra):
            if len(self.live) >= 4:
                return
            prompt = texts[conv][:cut] + texts[(conv + 1) % 4][:extra]
            self.live[self.eng.add_request(prompt, SP)] = prompt

        @rule(n=st.integers(1, 4))
        def step(self, n):
            for _ in range(n):
                self.eng.step()
                self.eng.check_integrity()
            self._collect()

        @precondition(lambda self: bool(getattr(self, "live", None)))
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.eng.abort(rid)
            self.eng.pop_finished(rid)
            del self.live[rid]

        @rule(component=st.sampled_from(["full", "swa"]), n=st.integers(1, 12))
        def evict(self, component, n):
            self.eng.cache.evict_l1(component, n)

        @rule()
        def wait_copies(self):
            self.eng.cache.poll(block=True)

        @rule()
        def flush_when_idle(self):
            if not self.eng.has_unfinished():
                self.eng.flush_cache()
                assert self.eng.pools.all_free() and self.eng.cache.host.all_free()

        def _collect(self):
            for rid in list(self.live):
                req = self.eng.requests[rid]
                if req.status.value == "finished":
                    out = self.eng.pop_finished(rid)
                    numerics.assert_same_output(out, want(self.live.pop(rid)), self.eng.model_config, rid)

        @invariant()
        def integrity(self):
            if hasattr(self, "eng"):
                self.eng.check_integrity()

        def teardown(self):
            if not hasattr(self, "eng"):
                return
            while self.eng.has_unfinished():
                self.eng.step()
            self._collect()
            assert not self.live
            self.eng.flush_cache()
            self.eng.check_integrity()
            assert self.eng.pools.all_free() and self.eng.cache.host.all_free()
            self.eng.cache.close()

    Machine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=15, deadline=None,
                                         derandomize=True, suppress_health_check=list(HealthCheck))
    Machine.TestCase().runTest()
