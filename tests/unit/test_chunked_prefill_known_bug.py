"""Issue #11, reproduced offline: this 626-token conversation turn (model output carried into the next
turn) prefilled in chunks of 512 gives logits 0.13 away from the same prompt prefilled at once (the
one-shot result agrees with transformers; greedy tokens depart at the 9th token). The cause is a top-k
MoE routing near-tie: at layer 1, position 573, the 2nd and 3rd expert logits are 6e-7 apart, and the
1e-6 noise between the two batch shapes gives that token another expert. Random prompts of the same
length agree to 1e-5.

Strict xfail: if routing becomes batch-invariant this passes, the run fails, and the marker must go."""
import json
import os

import pytest

from engine import Engine, SamplingParams

PROMPT = json.load(open(os.path.join(os.path.dirname(__file__), "data", "chunked_prefill_626.json")))["prompt"]


@pytest.mark.xfail(strict=True, reason="issue #11: a MoE routing near-tie makes chunked and one-shot prefill differ")
def test_chunked_prefill_equals_one_shot_on_a_soak_turn():
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, return_logits=True)
    one = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=1024, max_batch_tokens=4096)
    chunked = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=1024, max_batch_tokens=512)
    a = one.generate([PROMPT], sp)[0].logits[0].float()
    b = chunked.generate([PROMPT], sp)[0].logits[0].float()
    assert float((a - b).abs().max()) < 1e-3
