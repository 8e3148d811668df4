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
