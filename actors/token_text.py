"""A token as clients see it in logprobs: its name, and where it lies in the text they are sent.

Names. A byte-level vocabulary has tokens that are a fragment of a UTF-8 character (strata-tiny's bytes
0x80-0xff, a GPT-2 piece holding half an emoji): decoded alone each is U+FFFD, so several tokens would
share the name '\ufffd' and overwrite each other in a completions ``top_logprobs`` dict (a dict keyed by
name). OpenAI names such a token by its bytes, ``bytes:\\xe2\\x80``; strata does the same, so names are
distinct, and a name that still collides (two tokens with the same bytes: a sentencepiece byte-fallback
``<0x41>`` beside ``A``) falls back to vLLM's ``token_id:<id>``.

Offsets. ``text_offset`` is where each token starts in the text the client got. That text leaves out
special tokens when ``skip_special_tokens`` (the default), so a skipped token takes no characters; a
token that ends inside a character starts where that character starts."""
from __future__ import annotations

import codecs


def token_bytes(tok, tid: int) -> bytes:
    return bytes(tok.token_bytes(tid))


def token_name(tok, tid: int, as_ids: bool = False) -> str:
    """The token's text if its bytes are whole UTF-8, else ``bytes:\\xNN...`` (OpenAI's spelling);
    ``as_ids``: vLLM's ``token_id:<id>`` (``return_tokens_as_token_ids``)."""
    if as_ids:
        return f"token_id:{tid}"
    b = token_bytes(tok, tid)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def distinct_names(tok, tids: list[int], as_ids: bool = False, keep: int | None = None) -> list[str]:
    """Names for ``tids`` (the alternatives of one position), no two alike. ``keep``: a token whose own
    name must win a collision (the chosen token, so ``top_logprobs[i][tokens[i]]`` finds it)."""
    names = [token_name(tok, t, as_ids) for t in tids]
    taken = {names[tids.index(keep)]} if keep in tids else set()
    out = []
    for t, n in zip(tids, names):
        if t != keep and n in taken:
            n = f"token_id:{t}"
        taken.add(n)
        out.append(n)
    return out


class TextOffsets:
    """Character offsets of tokens in one decoded piece of text, fed in order (a stream's chunks one
    after another). ``start``: the offset of the piece (after an echoed prompt, say)."""

    def __init__(self, tok, start: int = 0, skip_special: bool = True) -> None:
        self.tok, self.pos, self.skip_special = tok, start, skip_special
        # Incremental: a character split over tokens (or over chunks) counts once, when it completes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True

    def feed(self, ids) -> list[int]:
        out = []
        for tid in ids:
            skipped = self.skip_special and self.tok.is_special(tid)
            b = b"" if skipped else token_bytes(self.tok, tid)
            out.append(self._start(b))
            if skipped:
                continue
            chars = self._utf8.decode(b)
            if self._first and chars:
                # A sentencepiece decoder strips the space its first "▁word" piece starts with.
                if chars.startswith(" ") and not self.tok.decode([tid], skip_special_tokens=False).startswith(" "):
                    chars = chars[1:]
                self._first = False
            self.pos += len(chars)
        return out

    def _start(self, b: bytes) -> int:
        """Where a token of bytes ``b`` starts. Bytes of an unfinished character are pending: if ``b``
        goes on with that character, the token starts where it does; if not, they end as U+FFFD (what
        the decoder writes for them) and the token starts after that."""
        pending = self._utf8.getstate()[0]
        if not pending:
            return self.pos
        try:
            codecs.getincrementaldecoder("utf-8")().decode(pending + b[:1], final=False)
            goes_on = bool(b)
        except UnicodeDecodeError:
            goes_on = False
        return self.pos if goes_on else self.pos + len(pending.decode("utf-8", "replace"))
