"""The HTTP frontend over one in-process engine (actors/local_backend.py, no Ray) as module fixtures, for
the tests that drive it with the official ``openai`` client: import the fixtures into a test module."""
import openai
import pytest
from fastapi.testclient import TestClient

from actors.http_api import build_app
from actors.local_backend import LocalBackend
from engine import Engine

MODEL = "strata-tiny"


@pytest.fixture(scope="module")
def http():
    backend = LocalBackend.from_pretrained(MODEL, page_size=16, num_pages=256, enable_prefix_cache=True)
    with TestClient(build_app(backend)) as c:
        c.tok = backend.tokenizer
        yield c
    backend.close()


@pytest.fixture(scope="module")
def oai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    return Engine.from_pretrained(MODEL, page_size=16, num_pages=256)
