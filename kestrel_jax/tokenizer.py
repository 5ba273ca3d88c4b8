"""Tokenizer: a thin wrapper over HF `tokenizers` plus a synthetic tokenizer for tests and demos.

The reference encodes with `tokenizer.encode(text).ids` under the library defaults (MOONDREAM.md
§6), so `Tokenizer.encode` does exactly that and adds nothing. Decoding skips special tokens.
Everything is loaded from local files; nothing here touches the network.

`StreamDecoder` turns a stream of generated ids into text chunks whose concatenation is
`Tokenizer.decode(all ids)`. It re-decodes a short window (the ids since the last emitted
boundary, plus the ids before it for context) and emits the difference, holding text back while it
ends in U+FFFD, i.e. while a multi-byte UTF-8 character is still split across tokens. Work per
token is therefore bounded by the window, not the length of the answer.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

TOKENIZER_FILE = "tokenizer.json"
N_SPECIAL = 16
EOS_TOKEN = "<|endoftext|>"
_REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file is missing or invalid, or an argument is out of range."""


class Tokenizer:
    """Encode / decode with a `tokenizers.Tokenizer` the way the Moondream reference does."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self.backend = backend

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {str(path)!r}")
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # the Rust loader raises plain Exception subclasses on bad JSON
            raise TokenizerError(f"cannot load tokenizer from {str(path)!r}: {e}") from e

    @classmethod
    def from_dir(cls, checkpoint_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load `<checkpoint_dir>/tokenizer.json` (HF layout)."""
        path = Path(checkpoint_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(
                f"no {TOKENIZER_FILE} in {str(checkpoint_dir)!r}; download the tokenizer next to the "
                "weights (e.g. moondream/starmie-v1) or pass its path explicitly"
            )
        return cls.from_file(path)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens skipped; ids the vocabulary lacks are ignored."""
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the text that became final with this id.

    Invariant: `"".join(chunks) + finish() == tokenizer.decode(all pushed ids)` whenever the
    decoder is prefix-stable on a window (later ids never change the text of earlier ones), as
    byte-level BPE decoders are. `_prefix` marks the start of the context window, `_read` the
    first id whose text has not been emitted yet.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def finish(self) -> str:
        """Emit whatever was held back (an incomplete character decodes to U+FFFD, as in decode)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        # Decoding the context ids together with the new ones keeps decoders that treat the
        # first token of a string specially (e.g. stripping a leading space) out of the diff.
        before = self._tok.decode(self._ids[self._prefix: self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]


# --------------------------------------------------------------------------------------------
# Synthetic tokenizer (tests, demo, synthetic checkpoints)

_CORPUS = """\
The image shows a small red house on a green hill under a clear blue sky.
A person is walking a brown dog along the beach at sunset, and the water is calm.
There are three cars parked on the street: a white car, a black car and a yellow taxi.
Describe the image in detail. What is in the picture? How many people are there?
Answer the question about the image. Point to the cat. Detect every person in the photo.
Write a short caption. Write a normal caption. Write a long caption for this image.
query caption detect point short normal long segment object objects question answer
The photo was taken outdoors during the day. The sun is shining and there are a few clouds.
In the center of the picture there is a large tree with green leaves and a wooden bench.
On the left side of the image, a woman in a blue dress is holding an umbrella.
On the right side, a man wearing a hat is sitting at a table with a cup of coffee.
The background shows tall buildings, windows, a bridge over a river and some boats.
In the foreground there is a road with white lines, a bicycle and a traffic light.
The cat is sleeping on a soft chair next to the window, and a book lies on the floor.
A bowl of fruit sits on the kitchen table: apples, bananas, oranges and grapes.
Two children are playing with a ball in the park while their parents watch them.
The text on the sign says "Welcome" in large black letters on a white background.
This is a screenshot of a web page with a menu, a search box and several buttons.
The chart shows sales by month; the highest value is in July and the lowest in January.
A circle, a square and a triangle are drawn in red, green and blue on a grey background.
The horizon divides the sky from the sea; the mountains in the distance are covered in snow.
Yes. No. It is a dog. There are 2 people, 4 chairs and 1 table in the room.
The numbers 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 20, 50, 100 and 1000 appear on the page.
She said: "I think it is going to rain today." He replied, "Maybe, but it looks sunny."
What color is the car? The car is red. Where is the ball? The ball is under the table.
Is there a person in the image? Yes, there is one person standing near the door.
Count the birds in the tree. There are five birds sitting on the branches.
The kitchen has white walls, a wooden floor, a stove, a sink and a refrigerator.
People are crossing the street at the intersection while cars wait at the red light.
An airplane is flying high above the clouds, leaving a long white trail behind it.
what is this? what is in the image? how many dogs are there? where is the cat? describe the scene.
which color is the bus? who is holding the cup? why is the road wet? when was the photo taken?
"""

_WORD_LIST = """
the a an image picture photo scene person people man woman child dog cat bird car bus tree
house road street sky water sea river mountain table chair window door book cup ball flower
red green blue yellow white black brown grey orange purple small large tall short old new
is are was sits stands walks runs holds looks shows has near under above behind next to on in
left right center top bottom front back background foreground two three four many some
"""
_WORDS = tuple(_WORD_LIST.split())


def _seeded_sentences(seed: int, n: int = 300) -> list[str]:
    """Extra corpus lines from a fixed word list; `seed` varies the learned merges a little."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ","]))
    return lines


def build_synthetic_tokenizer(vocab_size: int, seed: int = 0) -> tokenizers.Tokenizer:
    """Byte-level BPE tokenizer with exactly `vocab_size` ids, built offline and deterministically.

    Layout: ids 0..15 special (0 `<|endoftext|>`, 1..15 `<|md_reserved_0|>`..`<|md_reserved_14|>`),
    then the 256 byte symbols, then merges learned from a small built-in English corpus, then
    filler tokens `<|filler_N|>` up to `vocab_size`. Fillers are plain vocabulary entries that no
    merge produces: encoding never yields them, decoding shows them verbatim.
    """
    n_base = N_SPECIAL + len(pre_tokenizers.ByteLevel.alphabet())
    if not isinstance(vocab_size, int) or vocab_size < n_base:
        raise TokenizerError(f"vocab_size must be an int >= {n_base} (specials + bytes), got {vocab_size!r}")
    specials = [EOS_TOKEN] + [f"<|md_reserved_{i}|>" for i in range(N_SPECIAL - 1)]

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS.splitlines() * 3 + _seeded_sentences(seed)
    tok.train_from_iterator(corpus, trainer=trainer)

    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for i, name in enumerate(specials):
        if vocab.get(name) != i:
            raise AssertionError(f"trainer placed special token {name!r} at {vocab.get(name)}, not {i}")
    next_id = len(vocab)
    if sorted(vocab.values()) != list(range(next_id)):
        raise AssertionError("trainer produced a vocabulary with gaps")
    filler = 0
    while next_id < vocab_size:
        name = f"<|filler_{filler}|>"
        filler += 1
        if name in vocab:  # cannot happen with the built-in corpus; kept for safety
            continue
        vocab[name] = next_id
        next_id += 1
    out = tokenizers.Tokenizer.from_str(json.dumps(spec))
    if out.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built {out.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    return out
