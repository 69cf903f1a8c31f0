"""Tokenizers: any checkpoint's ``tokenizer.json`` through the ``tokenizers`` library, and the byte-level
tokenizer strata-tiny ships (id == byte value for 0..255, then the special tokens)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>")
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte, indexed by byte value (GPT-2 byte-level scheme:
    printable bytes stand for themselves, the others are shifted past 255)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, shift = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out


def build_byte_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_byte_tokenizer(path: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json into ``path``; returns the eos token id."""
    tok = build_byte_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return tok.token_to_id(EOS_TOKEN)


class TextTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` loaded from a checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise ValueError(f"model: no tokenizer.json in {path}")
        self._tok = Tokenizer.from_file(str(f))
        cfg_file = Path(path) / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = self.config.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
