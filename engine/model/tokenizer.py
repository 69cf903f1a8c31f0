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


def _inverse_byte_alphabet() -> dict[str, int]:
    global _INV
    if _INV is None:
        _INV = {ch: b for b, ch in enumerate(_byte_alphabet())}
    return _INV


_INV: dict[str, int] | None = None


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
        if isinstance(self.chat_template, list):   # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = Path(path) / "chat_template.jinja"     # newer checkpoints ship it on its own
        if self.chat_template is None and jinja_file.is_file():
            self.chat_template = jinja_file.read_text()
        # bos/eos/pad/unk as strings (tokenizer_config.json may give AddedToken dicts {"content": ...})
        self.special_tokens = {k: (v.get("content") if isinstance(v, dict) else v)
                               for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                               if isinstance(v := self.config.get(k), (str, dict))}

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **kwargs) -> str:
        """``messages`` through the checkpoint's chat template (engine/model/chat.py)."""
        from engine.model.chat import render_chat
        return render_chat(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           special=self.special_tokens, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: what the checkpoint's post-processor adds (a BOS, say); the serving
        routes never ask for it, vLLM's /tokenize may."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json document (what llguidance builds its token trie from)."""
        return self._tok.to_str()

    def piece(self, tid: int) -> str | None:
        """The token's entry in the vocabulary as the checkpoint spells it ("Ġthe", "▁the", "<0x0A>")."""
        return self._tok.id_to_token(tid)

    def is_special(self, tid: int) -> bool:
        """A special token: one that ``decode(..., skip_special_tokens=True)`` leaves out."""
        return tid in self._special_ids()

    def token_bytes(self, tid: int) -> bytes:
        """The bytes a token stands for (a byte-level token that is part of a character included)."""
        piece = self._tok.id_to_token(tid)
        if piece is None:
            return b""
        if tid in self._special_ids():
            return piece.encode()
        inv = _inverse_byte_alphabet()
        if all(c in inv for c in piece):   # byte-level BPE pieces (GPT-2 scheme)
            return bytes(inv[c] for c in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:   # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def _special_ids(self) -> set[int]:
        if not hasattr(self, "_specials"):
            self._specials = {t.id if hasattr(t, "id") else i for i, t in self._tok.get_added_tokens_decoder().items()
                              if t.special} if hasattr(self._tok, "get_added_tokens_decoder") else set()
        return self._specials
