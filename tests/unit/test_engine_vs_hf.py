"""strata's engine against transformers' GptOssForCausalLM loaded from the very same checkpoint."""
import pytest
import torch

from engine import Engine, SamplingParams
from engine.model.config import FULL_ATTN, SLIDING, RopeConfig
from engine.model.loader import random_state_dict, save_checkpoint, tiny_config
from tests import numerics

from .hf_ref import hf_greedy, load_hf

pytestmark = pytest.mark.numerics   # every test compares with another computation's tokens and logits

CONFIGS = {
    # strata-tiny itself: window 64, 8 experts top-2, GQA 4/2, YaRN.
    "tiny": dict(),
    # Smaller window, more heads, more experts, default RoPE, full layer first, sharded checkpoint.
    "w16_e16": dict(sliding_window=16, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    num_local_experts=16, num_experts_per_tok=4, num_hidden_layers=5,
                    layer_types=(FULL_ATTN, SLIDING, SLIDING, FULL_ATTN, SLIDING),
                    rope=RopeConfig(theta=10000.0)),
    # Multi-head (no GQA), window 24 not a multiple of the page size, YaRN with truncation.
    "w24_mha": dict(sliding_window=24, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=1, hidden_size=48, intermediate_size=32,
                    rope=RopeConfig(theta=50000.0, rope_type="yarn", factor=4.0,
                                    original_max_position_embeddings=512, truncate=True)),
}
ENGINE_ARGS = {"tiny": dict(page_size=16, max_batch_tokens=96),
               "w16_e16": dict(page_size=4, max_batch_tokens=40),
               "w24_mha": dict(page_size=8, max_batch_tokens=64, chunk_size=24)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    name = request.param
    cfg = tiny_config(**CONFIGS[name])
    path = tmp_path_factory.mktemp(name)
    save_checkpoint(path, cfg, random_state_dict(cfg, seed=7), shards=2 if name == "w16_e16" else 1)
    return name, path, cfg


def test_greedy_tokens_and_logits_match_transformers(ckpt):
    name, path, cfg = ckpt
    eng = Engine.from_pretrained(str(path), num_pages=512, **ENGINE_ARGS[name])
    w = cfg.sliding_window
    g = torch.Generator().manual_seed(3)
    lengths = [1, 3, w // 2, w - 1, w, w + 1, 2 * w + 5, 4 * w, 4 * w + 7, 5 * w]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    n_new = 20
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=n_new, ignore_eos=True, return_logits=True))
    # Chunked prefill really happened: at least one prompt was longer than a step's budget.
    assert max(lengths) > eng.cfg.effective_chunk_size
    hf = load_hf(path)
    for p, o in zip(prompts, outs):
        numerics.assert_same_output(o, hf_greedy(hf, p, n_new), cfg, f"{name}, prompt of {len(p)} tokens")
    assert eng.pools.all_free()
    eng.check_integrity()


def test_batched_equals_one_at_a_time():
    eng = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=256, max_batch_tokens=50)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 90, 200, 33, 64, 129, 1, 300)]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, return_logits=True)
    together = eng.generate(prompts, sp)
    alone = [eng.generate([p], sp)[0] for p in prompts]
    numerics.assert_same_outputs(together, alone, eng.model_config, "batched vs alone")


def test_per_expert_dispatch_path_matches_transformers(monkeypatch, tmp_path):
    """Large models dispatch tokens expert by expert instead of the dense tiny-model path."""
    import engine.model.moe_dispatch as moe_dispatch
    monkeypatch.setattr(moe_dispatch, "DENSE_MAX_ELEMS", 0)
    cfg = tiny_config(sliding_window=16, num_local_experts=16, num_experts_per_tok=4)
    save_checkpoint(tmp_path, cfg, random_state_dict(cfg, seed=11))
    eng = Engine.from_pretrained(str(tmp_path), page_size=4, num_pages=256, max_batch_tokens=32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 40, 70)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, return_logits=True))
    hf = load_hf(tmp_path)
    for p, o in zip(prompts, outs):
        numerics.assert_same_output(o, hf_greedy(hf, p, 10), cfg, f"prompt of {len(p)} tokens")
