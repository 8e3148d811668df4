"""Tokenizer wrapper and the incremental detokenizer (text deltas safe across UTF-8 and merges)."""

from __future__ import annotations

import random

import pytest
from gemma4_fixtures import make_tokenizer

from mmserve.model.tokenizer import IncrementalDetokenizer, TextTokenizer, load_tokenizer

SAMPLES = ["the cat sat", "café — naïve 東京 🐈‍⬛ ok", "a  b\n\tc", "thethe the  the", "é" * 7 + "🙂x"]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer(make_tokenizer())


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_deltas_concatenate_to_the_full_text(tok, text, seed):
    ids = tok.encode(text)
    rng = random.Random(seed)
    detok, deltas, i = IncrementalDetokenizer(tok), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("🐈")
    assert len(ids) == 4   # one byte-level token per UTF-8 byte in this tiny vocab
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids] == ["", "", "", "🐈"]


def test_special_tokens_are_skipped_in_stream(tok):
    ids = tok.encode("hi") + [tok.token_id("<turn|>")] + tok.encode(" there")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "hi there"


def test_load_tokenizer_from_checkpoint_dir(tmp_path, tok):
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("the cat") == tok.encode("the cat")
    assert loaded.token_id("<|video|>") == tok.token_id("<|video|>")
    with pytest.raises(Exception, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


def sentencepiece_style_tokenizer() -> TextTokenizer:
    """Gemma's real tokenizer kind: "▁" for spaces, byte fallback for unknown characters, and a
    decoder that strips the leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<turn|>": 4}
    vocab.update({f"<0x{b:02X}>": len(vocab) + i for i, b in enumerate(range(256))})
    for piece in ["▁", "t", "h", "e", "c", "a", "é", "▁t", "th", "▁th", "▁the", "at", "▁c", "▁cat"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("t", "h"), ("▁t", "h"), ("▁th", "e"), ("a", "t"), ("▁", "c"), ("▁c", "at")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<turn|>"])
    return TextTokenizer(tok)


@pytest.mark.parametrize("text", ["the cat", "the 🐈 cat é", "é🐈é the"])
def test_streaming_with_byte_fallback_and_leading_space_strip(text):
    tok = sentencepiece_style_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def _random_text(rng: random.Random, n: int) -> str:
    """Mixed scripts, spaces, digits and pieces the vocabularies merge (so long tokens occur)."""
    pieces = ["the", " the", " cat", "at", "th", "é", "東京", "🐈", " ", "  ", "\n", "0", "123", "triangle",
              " triangle", " square", "Ġ", "<|image|>", "x"]
    return "".join(rng.choice(pieces) if rng.random() < 0.7 else chr(rng.randint(32, 0x2FFF)) for _ in range(n))


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "demo"])
def test_min_tokens_is_a_lower_bound_on_fresh_random_text(tok, kind):
    """The bound refuses text before tokenizing it, so it must never exceed the real count."""
    from mmserve.config import DEMO_MODEL_DIR

    tokenizer = {"byte-level": lambda: tok, "sentencepiece": sentencepiece_style_tokenizer,
                 "demo": lambda: load_tokenizer(DEMO_MODEL_DIR)}[kind]()
    assert tokenizer.max_chars_per_token is not None
    rng = random.Random(random.getrandbits(64))
    for _ in range(30):
        text = _random_text(rng, rng.randint(1, 400))
        assert len(tokenizer.encode(text)) >= tokenizer.min_tokens(len(text)) > 0, text
    longest = "triangle" if kind == "demo" else "the"  # the bound is reached by the longest token
    assert tokenizer.min_tokens(len(longest) * 50) <= len(tokenizer.encode(longest * 50))


def test_a_normalizer_that_can_drop_text_gives_no_bound():
    from tokenizers import Tokenizer, models, normalizers

    stripping = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    stripping.normalizer = normalizers.Strip()
    tokenizer = TextTokenizer(stripping)
    assert tokenizer.max_chars_per_token is None and tokenizer.min_tokens(10**6) == 0


def test_encoding_lets_other_threads_run(tok):
    """A long text is tokenized on a worker thread; the event loop's thread must keep running.

    Holding the GIL, encode would let the sibling run at most at the call's edges (a switch
    interval's worth before the native code starts), so a tick in the middle of the call proves the
    GIL was free there. Counting ticks per second instead failed on a loaded machine."""
    import threading
    import time

    stamps, done = [], threading.Event()

    def tick():
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0005)

    sibling = threading.Thread(target=tick)
    sibling.start()
    while not stamps:   # the sibling runs before the call starts
        time.sleep(0.001)
    started = time.perf_counter()
    tok.encode("a" * 2_000_000)
    ended = time.perf_counter()
    done.set()
    sibling.join()
    took = ended - started
    middle = [t for t in stamps if started + 0.25 * took < t < ended - 0.05 * took]
    assert middle, f"no tick in the middle of a {took:.3f}s encode ({len(stamps)} ticks in all)"
