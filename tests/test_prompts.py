"""Prompt assembly against the golden prompts and with configs whose ids differ from the defaults."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from kestrel_jax.models.config import (
    Templates,
    TokenizerConfig,
    config_from_dict,
    md2_config,
    md3_config,
    tiny_config,
)
from kestrel_jax.prompts import (
    Prompt,
    PromptError,
    SpatialRef,
    box_from_center,
    caption_prompt,
    default_query_reasoning,
    detect_prompt,
    point_prompt,
    query_prompt,
    segment_prompt,
)
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("KESTREL_GOLDEN_DIR", REPO / ".." / "shared" / "golden"))

# The golden run fed fixed ids instead of tokenizing: the question and the detect object map to
# these (the object with its leading space). Any other string is an error, which also checks
# that the question is passed without a leading space and the object with one.
QUESTION = "What is in this image?"
QUESTION_IDS = [412, 3187, 95, 2046, 7001, 58, 1290]
OBJECT = "car"
OBJECT_IDS = [5120, 881]


def fake_encode(text: str) -> list[int]:
    table = {QUESTION: QUESTION_IDS, " " + OBJECT: OBJECT_IDS}
    if text not in table:
        raise KeyError(f"fake encoder got unexpected text {text!r}")
    return list(table[text])


def _golden(family: str):
    path = GOLDEN / family / "config.json"
    if not path.is_file():
        pytest.skip("golden vectors not available")
    cfg = config_from_dict(json.loads(path.read_text()))
    assert cfg.family == family
    return cfg, json.loads((GOLDEN / family / "golden.json").read_text())


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_golden_prompts(family):
    cfg, gold = _golden(family)
    plain = query_prompt(cfg, fake_encode, QUESTION, reasoning=False)
    assert list(plain.ids) == gold["prompt_ids"]
    assert plain.coord_slots == () and plain.size_slots == ()
    reasoning = query_prompt(cfg, fake_encode, QUESTION, reasoning=True)
    assert list(reasoning.ids) == gold["reasoning_prompt_ids"]
    assert list(detect_prompt(cfg, fake_encode, OBJECT).ids) == gold["detect_prompt_ids"]
    # The reasoning phase ends with answer_id prefilled, as the golden run did.
    assert gold["reasoning_answer_prefill_ids"] == [cfg.tokenizer.answer_id]


def test_family_tails():
    enc = fake_encode
    q = QUESTION_IDS
    md2, md3 = md2_config(), md3_config()
    assert query_prompt(md2, enc, QUESTION, reasoning=False).ids == (1, 15381, 2, *q, 3, 3)
    assert query_prompt(md2, enc, QUESTION, reasoning=True).ids == (1, 15381, 2, *q, 3, 4)
    assert query_prompt(md3, enc, QUESTION, reasoning=False).ids == (1, 15381, 2, *q, 3)
    assert query_prompt(md3, enc, QUESTION, reasoning=True).ids == (1, 15381, 2, *q, 4)
    assert point_prompt(md3, enc, OBJECT).ids == (1, 2581, 2, *OBJECT_IDS, 3)
    assert detect_prompt(md2, enc, OBJECT).ids == (1, 7235, 476, 2, *OBJECT_IDS, 3)
    assert default_query_reasoning(md2) is False and default_query_reasoning(md3) is True


def test_caption_lengths():
    cfg = tiny_config("md2")
    for length in ("short", "normal", "long"):
        p = caption_prompt(cfg, length)
        assert p.ids == cfg.tokenizer.templates.caption[length]
    assert caption_prompt(cfg).ids == cfg.tokenizer.templates.caption["normal"]
    with pytest.raises(PromptError, match="unknown caption length"):
        caption_prompt(cfg, "medium")


def _remapped_config():
    """A config whose every special id and template differs from the defaults."""
    tm = Templates(
        caption={"short": (11, 901, 12, 902, 13), "normal": (11, 901, 12, 903, 13), "long": (11, 904, 13)},
        query_prefix=(11, 910, 12), query_suffix=(13,),
        detect_prefix=(11, 920, 921, 12), detect_suffix=(13, 13),
        point_prefix=(11, 930, 12), point_suffix=(14,),
    )
    tk = TokenizerConfig(bos_id=50, eos_id=50, answer_id=13, thinking_id=15, coord_id=16, size_id=17,
                         start_ground_points_id=18, end_ground_id=19, templates=tm)
    return tk


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_ids_come_from_the_config(family):
    cfg = dataclasses.replace(tiny_config(family), tokenizer=_remapped_config())
    q = QUESTION_IDS
    tail = {("md2", False): (13, 13), ("md2", True): (13, 15), ("md3", False): (13,), ("md3", True): (15,)}
    for reasoning in (False, True):
        p = query_prompt(cfg, fake_encode, QUESTION, reasoning=reasoning, spatial_refs=[(0.25, 0.75)])
        assert p.ids == (11, 910, 12, 16, 16, *q, *tail[family, reasoning])
        assert p.coord_slots == ((3, 0.25), (4, 0.75))
    assert detect_prompt(cfg, fake_encode, OBJECT).ids == (11, 920, 921, 12, *OBJECT_IDS, 13, 13)
    assert point_prompt(cfg, fake_encode, OBJECT).ids == (11, 930, 12, *OBJECT_IDS, 14)
    assert caption_prompt(cfg, "long").ids == (11, 904, 13)


# --------------------------------------------------------------------------------------------
# Spatial references


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_spatial_refs_slots(family):
    cfg = md2_config() if family == "md2" else md3_config()
    tk = cfg.tokenizer
    refs: list[SpatialRef] = [(0.1, 0.2), (0.2, 0.4, 0.6, 0.5), {"x": 1.0, "y": 0.0},
            {"x_min": 0.0, "y_min": 0.0, "x_max": 1.0, "y_max": 1.0}]
    p = query_prompt(cfg, fake_encode, QUESTION, reasoning=False, spatial_refs=refs)
    n_prefix = len(tk.templates.query_prefix)
    c, s = tk.coord_id, tk.size_id
    assert p.ids[:n_prefix] == tk.templates.query_prefix
    assert p.ids[n_prefix: n_prefix + 10] == (c, c, c, c, s, c, c, c, c, s)
    assert p.ids[n_prefix + 10: n_prefix + 17] == tuple(QUESTION_IDS)
    b = n_prefix
    expected_coords = [(b, 0.1), (b + 1, 0.2), (b + 2, 0.4), (b + 3, 0.45), (b + 5, 1.0), (b + 6, 0.0),
                       (b + 7, 0.5), (b + 8, 0.5)]
    assert [i for i, _ in p.coord_slots] == [i for i, _ in expected_coords]
    assert [v for _, v in p.coord_slots] == pytest.approx([v for _, v in expected_coords])
    assert [i for i, _ in p.size_slots] == [b + 4, b + 9]
    assert p.size_slots[0][1] == pytest.approx((0.4, 0.1))
    assert p.size_slots[1][1] == (1.0, 1.0)
    for i, _ in p.coord_slots:
        assert p.ids[i] == c
    for i, _ in p.size_slots:
        assert p.ids[i] == s
    assert sum(1 for t in p.ids if t == c) == len(p.coord_slots)


@pytest.mark.parametrize(
    ("refs", "match"),
    [
        ([(0.5, 1.5)], r"\[0, 1\]"),
        ([(-0.1, 0.5)], r"\[0, 1\]"),
        ([(float("nan"), 0.5)], r"\[0, 1\]"),
        ([(0.1, 0.2, 0.3)], "2 values"),
        ([(0.1,)], "2 values"),
        ([(0.6, 0.2, 0.4, 0.5)], "x_min <= x_max"),
        ([(0.1, 0.5, 0.4, 0.2)], "y_min <= y_max"),
        ([("a", 0.2)], "numbers"),
        ([None], "expected"),
        ([0.5, 0.5], "expected"),  # a bare point instead of a list of refs
        (["ab"], "expected"),
        ([{"x": 0.1}], "missing"),
    ],
)
def test_bad_spatial_refs(refs, match):
    with pytest.raises(PromptError, match=match):
        query_prompt(md3_config(), fake_encode, QUESTION, reasoning=True, spatial_refs=refs)


# --------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_text(text):
    cfg = md2_config()
    with pytest.raises(PromptError, match="empty"):
        query_prompt(cfg, fake_encode, text, reasoning=False)
    with pytest.raises(PromptError, match="empty"):
        detect_prompt(cfg, fake_encode, text)
    with pytest.raises(PromptError, match="empty"):
        point_prompt(cfg, fake_encode, text)


def test_non_string_and_bad_encoder_output():
    cfg = tiny_config("md3")
    with pytest.raises(PromptError, match="string"):
        query_prompt(cfg, fake_encode, 42, reasoning=False)  # type: ignore[arg-type]
    with pytest.raises(PromptError, match="outside the model's vocabulary"):
        query_prompt(cfg, lambda s: [5, cfg.text.vocab_size], "hi", reasoning=False)
    with pytest.raises(PromptError, match="outside the model's vocabulary"):
        detect_prompt(cfg, lambda s: [-1], "cat")
    with pytest.raises(PromptError, match="no tokens"):
        point_prompt(cfg, lambda s: [], "cat")


def test_length_limits():
    cfg = md3_config()
    n = len(query_prompt(cfg, fake_encode, QUESTION, reasoning=True))
    assert n == 3 + len(QUESTION_IDS) + 1
    assert len(query_prompt(cfg, fake_encode, QUESTION, reasoning=True, max_prompt_tokens=n)) == n
    with pytest.raises(PromptError, match="above the limit"):
        query_prompt(cfg, fake_encode, QUESTION, reasoning=True, max_prompt_tokens=n - 1)
    with pytest.raises(PromptError, match="above the limit"):
        detect_prompt(cfg, fake_encode, OBJECT, max_prompt_tokens=3)
    with pytest.raises(PromptError, match="above the limit"):
        caption_prompt(cfg, "short", max_prompt_tokens=4)
    # Without an explicit limit, the context left after the image prefix still bounds the prompt.
    room = cfg.text.max_context - cfg.text.prefix_attn
    with pytest.raises(PromptError, match="above the limit"):
        query_prompt(cfg, lambda s: [7] * room, "long question", reasoning=False)


def test_prompt_is_frozen_and_with_real_tokenizer():
    tok = Tokenizer(build_synthetic_tokenizer(8192))
    cfg = tiny_config("md2")
    p = query_prompt(cfg, tok.encode, "How many dogs are there?", reasoning=False)
    assert isinstance(p, Prompt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.ids = ()  # type: ignore[misc]
    body = p.ids[len(cfg.tokenizer.templates.query_prefix): -2]
    assert tok.decode(body) == "How many dogs are there?"
    d = detect_prompt(cfg, tok.encode, "red car")
    assert tok.decode(d.ids[len(cfg.tokenizer.templates.detect_prefix): -1]) == " red car"


def test_box_from_center_clamps_to_the_image_unless_asked_not_to():
    """Centre -+ size / 2; the engine's boxes are clamped to [0, 1] (Kestrel's output), the
    reference's are not (the golden parity checks compare those)."""
    inside = box_from_center(0.5, 0.25, 0.5, 0.25)
    assert inside == {"x_min": 0.25, "y_min": 0.125, "x_max": 0.75, "y_max": 0.375}
    assert box_from_center(0.5, 0.25, 0.5, 0.25, clamp=False) == inside
    past = box_from_center(0.9, 0.1, 0.5, 0.5, clamp=False)
    assert past == {"x_min": 0.65, "y_min": -0.15, "x_max": 1.15, "y_max": 0.35}
    assert box_from_center(0.9, 0.1, 0.5, 0.5) == {"x_min": 0.65, "y_min": 0.0, "x_max": 1.0, "y_max": 0.35}


# --------------------------------------------------------------------------------------------
# Segment (MD3 family only)


def test_segment_prompt_md3_only_with_refs_and_no_leading_space():
    cfg = md3_config()
    tk = cfg.tokenizer
    enc = {"car": [5120, 881]}.__getitem__  # no leading space: " car" would raise KeyError
    p = segment_prompt(cfg, enc, "car", spatial_refs=[(0.2, 0.4, 0.6, 0.5)])
    assert p.ids == (1, 17374, 2, tk.coord_id, tk.coord_id, tk.size_id, 5120, 881, 3)
    assert [i for i, _ in p.coord_slots] == [3, 4] and p.coord_slots[0][1] == pytest.approx(0.4)
    assert p.size_slots[0][0] == 5 and p.size_slots[0][1] == pytest.approx((0.4, 0.1))
    assert segment_prompt(cfg, enc, "car").ids == (1, 17374, 2, 5120, 881, 3)
    # point takes spatial refs too (Kestrel's), before the object with its leading space
    pp = point_prompt(cfg, fake_encode, OBJECT, spatial_refs=[(0.25, 0.75)])
    assert pp.ids == (1, 2581, 2, tk.coord_id, tk.coord_id, *OBJECT_IDS, 3) and pp.coord_slots == ((3, 0.25), (4, 0.75))
    for c in (md2_config(), tiny_config("md2")):
        with pytest.raises(PromptError, match="no segment skill"):
            segment_prompt(c, enc, "car")
    with pytest.raises(PromptError, match="object"):
        segment_prompt(cfg, enc, " ")


def test_segment_template_in_checkpoint_configs():
    """config.json round trip; MD2 never has one; a config naming none keeps the family's when the
    vocabulary holds it, else none (a small synthetic checkpoint written before the skill)."""
    from kestrel_jax.models.config import config_to_dict

    for cfg in (md3_config(), tiny_config("md3"), md2_config(), tiny_config("md2")):
        back = config_from_dict({"config": config_to_dict(cfg)}, family=cfg.family)
        assert back.tokenizer.templates == cfg.tokenizer.templates
    assert md3_config().tokenizer.templates.has_segment and not md2_config().tokenizer.templates.has_segment
    old = config_to_dict(tiny_config("md3"))
    del old["tokenizer"]["templates"]["segment"]
    assert not config_from_dict({"config": old}, family="md3").tokenizer.templates.has_segment
    full = config_to_dict(md3_config())
    del full["tokenizer"]["templates"]["segment"]
    assert config_from_dict({"config": full}, family="md3").tokenizer.templates.segment_prefix == (1, 17374, 2)
    named = config_to_dict(tiny_config("md2"))
    named["tokenizer"]["templates"]["segment"] = {"prefix": [1, 9, 2], "suffix": [3]}
    assert not config_from_dict({"config": named}, family="md2").tokenizer.templates.has_segment
