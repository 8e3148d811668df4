"""The checkpoint's `tokenizer.json` through `tokenizers`, plus streaming detokenization.

User text is encoded with special-token parsing off, so a literal "<|image|>" typed by a user stays
text and can never forge a placeholder; the prompt builder inserts special ids itself.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from mmserve.errors import MMServeError


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for libraries that build their own token tables)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (turn markers, image/video placeholders, bos/eos...)."""
        return self._special_ids

    def token_id(self, token: str) -> int:
        """Id of a (special) token; raises when the tokenizer lacks it."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise MMServeError(f"tokenizer has no {token!r} token")
        return tid

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids; special-token strings inside `text` are encoded as ordinary text."""
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load `tokenizer.json` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise MMServeError(f"{path}: no tokenizer.json")
    return TextTokenizer(Tokenizer.from_file(str(file)))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always safe to show.

    Decodes a small window (from `prefix` to the end) and emits only the part beyond the
    previously emitted window, holding back while the tail is an incomplete UTF-8 sequence
    (decoded as U+FFFD). Decoding a window rather than single tokens keeps merge-dependent
    spacing right.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the new text (possibly empty)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (replacement chars included)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]
