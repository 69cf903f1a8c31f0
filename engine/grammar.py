"""Structured output: a request's grammar (JSON schema, any JSON object, regex, EBNF/GBNF or Lark) as an
llguidance matcher that gives the allowed next tokens each step and consumes the sampled one.

llguidance rather than xgrammar: it installs as one abi3 wheel with no dependencies and runs on CPU,
while xgrammar pulls transformers and a TVM runtime into the serving process. The matcher writes its
bitmask into a buffer of ours, unpacked here in torch. Not through ``llguidance.torch``: importing it
imports torch.compile's machinery (torch._dynamo, inductor: ~1.8 s of every process that imports the
engine, the ingress and each worker included, at each start and restart) for one pointer call.

llguidance is imported when present (engine/grammar_compile.py, which compiles and checks a grammar
without torch, for the ingress too): an engine without it (a GPU image that lacks the wheel) serves
everything but structured output, whose requests are refused with a ValueError naming the package."""
from __future__ import annotations

import torch

import engine.grammar_compile as compiled
from engine.sampling import SamplingParams


class GrammarTokenizer:
    """The llguidance view of a checkpoint's tokenizer (built once per engine)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        compiled.require()
        self.vocab_size = vocab_size
        self.ll = compiled.llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                  eos_token=list(eos_ids) or None)
        self.words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    def matcher(self, params: SamplingParams) -> "Matcher | None":
        if params.grammar is None:
            return None
        g = compiled.compile_grammar(*params.grammar)
        m = compiled.llguidance.LLMatcher(self.ll, g, log_level=0)
        if m.is_error():
            raise ValueError(f"grammar: {m.get_error()[:500]}")
        return Matcher(self, m)


class Matcher:
    """One request's grammar state."""

    def __init__(self, tok: GrammarTokenizer, m) -> None:
        self.tok, self.m = tok, m
        self._buf = torch.empty(tok.words, dtype=torch.int32)   # contiguous, on the CPU: the matcher writes it

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next: [vocab] bool."""
        self.m.unsafe_compute_mask_ptr(self._buf.data_ptr(), self._buf.numel() * self._buf.element_size())
        bits = (self._buf[:, None] >> self.tok._bits) & 1
        return bits.reshape(-1)[:self.tok.vocab_size].bool()

    def consume(self, token: int) -> None:
        """Advance past ``token``; a token the grammar did not allow is an engine bug, not user input."""
        if not self.m.consume_token(token):
            raise RuntimeError(f"grammar: token {token} was not allowed ({self.m.get_error()[:200]})")

    @property
    def done(self) -> bool:
        """Nothing more can follow (the grammar is complete and allows no continuation)."""
        return self.m.is_stopped()
