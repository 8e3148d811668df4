"""The checkpoint's `tokenizer.json` through `tokenizers`, plus streaming detokenization.

User text is encoded with special-token parsing off, so a literal "<|image|>" typed by a user stays
text and can never forge a placeholder; the prompt builder inserts special ids itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenizers import Tokenizer

from mmserve.errors import MMServeError


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        spec = tokenizer.to_str()  # tens of MB for a 262k vocabulary: serialised once
        self._plain = Tokenizer.from_str(spec)
        self._plain.encode_special_tokens = True
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.max_chars_per_token = max_chars_per_token(json.loads(spec))

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens `num_chars` characters of text become, known without tokenizing
        (0 when this tokenizer's normalizer gives no bound)."""
        return math.ceil(num_chars / self.max_chars_per_token) if self.max_chars_per_token else 0

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
        """Plain text -> ids; special-token strings inside `text` are encoded as ordinary text.

        Through `encode_batch`, which releases the GIL while it works (`encode` holds it): a long text
        tokenized on a worker thread must not freeze the event loop."""
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


# Normalizers that never merge input characters (each output character comes from at most one input
# character), so a token covers at most as many input characters as it has; NFC/NFKC compose at
# most three characters into one (Hangul L+V+T).
_NON_MERGING = {"Prepend": 1, "Lowercase": 1, "NFD": 1, "NFKD": 1, "NFC": 3, "NFKC": 3}


def _merge_factor(normalizer: dict | None) -> int | None:
    """How many input characters can become one normalized character; None when unbounded (Strip)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", []):
            step = _merge_factor(inner)
            if step is None:
                return None
            factor *= step
        return factor
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        return 1 if pattern is not None and len(pattern) <= max(1, len(normalizer.get("content", ""))) else None
    return _NON_MERGING.get(kind)


def max_chars_per_token(spec: dict) -> int | None:
    """The most input characters one token of this tokenizer (its `tokenizer.json` as a dict) can cover.

    A vocab entry's length bounds the characters it spells: byte-level entries spell one byte per
    character, and a character is at least one byte; byte-fallback entries (`<0x41>`) spell one byte.
    None when the normalizer can shrink text without bound (nothing is refused early then)."""
    factor = _merge_factor(spec.get("normalizer"))
    if factor is None:
        return None
    vocab = spec.get("model", {}).get("vocab") or {}
    entries = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)  # BPE/WordPiece | Unigram
    added = (token.get("content", "") for token in spec.get("added_tokens", []))
    longest = max((1 if _is_byte_fallback(t) else len(t) for t in [*entries, *added]), default=1)
    return max(1, longest) * factor


def _is_byte_fallback(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


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
