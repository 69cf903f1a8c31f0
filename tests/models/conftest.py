import pytest

from .families import load_hf, write_family

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma3", "gemma3_legacy", "gpt_oss_mxfp4")


@pytest.fixture(scope="package", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint path, transformers' model on it)."""
    name = request.param
    path = write_family(name, tmp_path_factory.mktemp(name), shard=name in ("qwen3", "gemma3"))
    return name, path, load_hf(name, path)
