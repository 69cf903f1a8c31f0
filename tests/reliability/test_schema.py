"""schemathesis against the OpenAPI schema the real cluster serves, every endpoint, valid and invalid
inputs (its coverage and fuzzing phases): no 5xx, every response (JSON bodies, SSE events, errors)
conforms to the declared schema, invalid data is refused, and the server keeps serving.

The schema is built at collection time from the same ``build_app`` (schemathesis needs it before any
fixture runs) and ``test_the_served_schema_is_the_one_fuzzed`` proves it is the one served.

Not checked: ``positive_data_acceptance``. A schema cannot say everything the server refuses on purpose
with a 400 naming the field (exactly one of text/input_ids, prompt + max tokens beyond the context)."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from actors.http_api import build_app
from cluster.config import load_config
from engine.model.config import ModelConfig
from engine.model.checkpoint import resolve_model_path
from tests.reliability.harness import DEFAULT_CONFIG

pytestmark = pytest.mark.slow   # the real cluster: `make test` runs it, `make test-fast` does not

MAX_NEW = 8  # valid cases generate at most this many tokens: fuzzing input, not generation length

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance,
          checks.negative_data_rejection]


class _SchemaOnly:
    """What build_app reads while building the schema; serving goes to the real cluster."""

    def __init__(self) -> None:
        cfg = load_config(DEFAULT_CONFIG)
        mc = ModelConfig.from_dir(resolve_model_path(cfg.engine.model))
        self.model_name, self.vocab_size, self.max_context = cfg.server.model_name, mc.vocab_size, \
            mc.max_position_embeddings


DOC = build_app(_SchemaOnly()).openapi()
schema = schemathesis.openapi.from_dict(DOC)
schema.config.generation.update(modes=["positive", "negative"], max_examples=30)


@schema.hook
def map_case(ctx, case):
    """Keep valid cases' generation short (invalid ones are left exactly as generated)."""
    b = case.body
    if case.meta is not None and case.meta.generation.mode.is_positive and isinstance(b, dict):
        for holder, k in ((b, "max_tokens"), (b, "max_completion_tokens"),
                          (b.get("sampling_params"), "max_new_tokens")):
            if isinstance(holder, dict) and type(holder.get(k)) is int and holder[k] > MAX_NEW:
                holder[k] = MAX_NEW
    return case


def test_the_served_schema_is_the_one_fuzzed(rcluster):
    served = httpx.get(f"{rcluster['url']}/openapi.json", timeout=60).json()
    assert served == DOC
    assert set(DOC["paths"]) == {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/v1/models/{model_id}", "/get_model_info", "/model_info", "/get_server_info",
                                 "/server_info", "/health", "/flush_cache", "/metrics", "/tokenize", "/detokenize"}


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_endpoint_conforms_and_never_5xx(case, rcluster):
    case.call_and_validate(base_url=rcluster["url"], checks=CHECKS, timeout=120)


def test_the_server_still_serves_after_fuzzing(rcluster):
    r = httpx.post(f"{rcluster['url']}/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2

