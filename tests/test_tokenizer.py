"""Tokenizer wrapper, stream decoding and the synthetic tokenizer."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kestrel_jax.tokenizer import N_SPECIAL, Tokenizer, TokenizerError, build_synthetic_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "Describe the image.",
    "How many people are there? There are 2 people, 4 chairs and 1 table.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "café naïve résumé — “quotes” 日本語のテキスト 🙂👍🏽 emoji",
    "",
    "x",
    "<not a special token> <|endoftext> |>",
]


def _rng() -> tuple[np.random.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


@functools.cache
def _tok(vocab_size: int = 8192) -> Tokenizer:
    return Tokenizer(build_synthetic_tokenizer(vocab_size))


@pytest.mark.parametrize("vocab_size", [8192, 51200, 272, 1000])
def test_exact_vocab_size_and_specials(vocab_size):
    t0 = time.perf_counter()
    backend = build_synthetic_tokenizer(vocab_size)
    elapsed = time.perf_counter() - t0
    tok = Tokenizer(backend)
    assert tok.vocab_size == vocab_size
    assert backend.get_vocab_size(with_added_tokens=False) == vocab_size
    assert sorted(backend.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))
    assert tok.id_to_token(vocab_size) is None
    assert tok.id_to_token(0) == "<|endoftext|>"
    for i in range(4):
        assert tok.token_to_id(f"<|md_reserved_{i}|>") == 1 + i
    for i in range(N_SPECIAL):  # every special decodes to nothing (skipped)
        assert tok.decode([i]) == ""
    assert elapsed < 10.0  # typically ~0.1 s; generous for a loaded CI machine


def test_too_small_vocab_is_rejected():
    with pytest.raises(TokenizerError, match="vocab_size"):
        build_synthetic_tokenizer(100)


def test_common_words_are_short():
    tok = _tok()
    for word in ("the", "image", "people", "dog", "car", "red", "caption", "detect", "point", "query"):
        assert len(tok.encode(" " + word)) <= 2, word
    assert len(tok.encode("Describe the image.")) <= 6


@pytest.mark.parametrize("vocab_size", [8192, 51200])
def test_round_trip_and_no_special_or_filler_ids_from_text(vocab_size):
    tok = _tok(vocab_size)
    first_filler = tok.token_to_id("<|filler_0|>")
    assert first_filler is not None and N_SPECIAL + 256 < first_filler < vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(N_SPECIAL <= i < first_filler for i in ids), (text, ids)


def test_encode_is_plain_ids_and_decode_skips_specials():
    tok = _tok()
    ids = tok.encode("a red car")
    assert ids == tok.backend.encode("a red car").ids  # nothing added at either end
    assert tok.decode([0, 1, *ids, 3, 4, 0]) == "a red car"
    # Ids past the vocabulary (padding rows of a larger embedding table) are ignored.
    assert tok.decode([*ids, tok.vocab_size + 17]) == "a red car"
    # Fillers decode verbatim, so they show up if a random model emits them.
    assert tok.decode([tok.vocab_size - 1]).startswith("<|filler_")


def test_determinism_in_process_and_across_processes():
    a = build_synthetic_tokenizer(8192).to_str()
    assert build_synthetic_tokenizer(8192).to_str() == a
    assert build_synthetic_tokenizer(8192, seed=1).to_str() != a  # the seed feeds the corpus
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="1", PYTHONPATH=str(REPO))
    code = "from kestrel_jax.tokenizer import build_synthetic_tokenizer as b; print(b(8192).to_str())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a


def test_from_file_and_from_dir(tmp_path):
    tok = _tok()
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    for loaded in (Tokenizer.from_dir(tmp_path), Tokenizer.from_file(tmp_path / "tokenizer.json")):
        for text in TEXTS:
            assert loaded.encode(text) == tok.encode(text)
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_file(tmp_path / "bad.json")


# --------------------------------------------------------------------------------------------
# Streaming


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.stream_decoder()
    chunks = [dec.push(i) for i in ids]
    chunks.append(dec.finish())
    assert dec.ids == tuple(ids)
    return chunks


def test_stream_holds_back_split_characters():
    tok = _tok()
    ids = tok.encode("日本")  # byte-level: each 3-byte character spans several tokens
    assert len(ids) > 2
    chunks = _stream(tok, ids)
    assert "".join(chunks) == "日本"
    assert all("\ufffd" not in c for c in chunks)
    assert set(chunks) - {""} == {"日", "本"}


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_on_text(text):
    tok = _tok()
    ids = tok.encode(text)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)


def test_stream_equals_full_decode_on_random_ids():
    tok = _tok()
    rng, seed = _rng()
    first_filler = tok.token_to_id("<|filler_0|>")
    assert first_filler is not None
    for _ in range(40):
        n = int(rng.integers(1, 60))
        # Mix of learned tokens, raw byte tokens (often invalid UTF-8), specials and fillers.
        ids = rng.integers(0, first_filler, size=n).tolist()
        ids += rng.integers(N_SPECIAL, N_SPECIAL + 256, size=int(rng.integers(0, 5))).tolist()
        ids += rng.integers(0, tok.vocab_size, size=int(rng.integers(0, 3))).tolist()
        rng.shuffle(ids)
        chunks = _stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids), f"seed {seed}, ids {ids}"


def test_stream_after_finish_and_empty():
    tok = _tok()
    dec = tok.stream_decoder()
    assert dec.finish() == ""
    first_byte = tok.encode("é")[0]
    assert dec.push(first_byte) == ""  # half a character: held back
    assert dec.finish() == "\ufffd"  # ...and flushed as decode() would show it
    assert dec.finish() == ""
    assert dec.push_many(tok.encode(" ok")) == " ok"
