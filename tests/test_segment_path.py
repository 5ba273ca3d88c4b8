"""The segment skill's host side: path tokens -> SVG path (Kestrel's format), the bounding box, the
path mapped onto the image and rasterised; and the engine Job's segment transitions."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.prompts import Prompt
from kestrel_jax.segment import (
    PathError,
    parse_path,
    path_polylines,
    path_token_strings,
    scaled_path,
    segment_bbox,
    segment_mask,
    segment_output,
    segment_polygons,
)
from kestrel_jax.serving.batch import FLAG_SEGMENT
from kestrel_jax.serving.skills import IN_COORD, IN_SIZE, IN_TOKEN, Job, Settings, StepOut

# a toy vocabulary: ids <= 20 are control tokens; path words from 100 up
WORDS = {100: "M", 101: " L", 102: "C", 103: "Z", 104: " -", 105: "0", 106: "480", 107: "960", 108: "240",
         109: " 120", 110: "h", 111: "  ", 112: "oops", 113: "12a"}


def decode(ids: list[int]) -> str:
    return "".join(WORDS.get(i, "") for i in ids)


def test_path_tokens_parse_and_scale_as_kestrel() -> None:
    ids = [5, 100, 105, 105, 101, 107, 105, 111, 101, 107, 107, 104, 108, 103, 0]
    toks = path_token_strings(decode, ids)
    assert toks == ["M", "0", "0", "L", "960", "0", "L", "960", "960", "-", "240", "Z"]  # ids <= 20, blanks out
    cmds = parse_path(toks)
    # the L's third number (-240) has no partner: dropped, as Kestrel does
    assert cmds == [("M", [0, 0]), ("L", [960, 0]), ("L", [960, 960]), ("Z", [])]
    assert scaled_path(cmds) == "M 0 0 L 1 0 L 1 1 Z"
    assert scaled_path([("M", [480, -120]), ("h", [240]), ("C", [1, 2, 3, 4, 5, 6])]) == \
        "M 0.5 -0.125 h 0.25 C 0.001 0.002 0.003 0.004 0.005 0.006"
    for bad, match in ((["0", "M"], "command"), (["M", "oops"], "number"), (["M", "12a"], "number")):
        with pytest.raises(PathError, match=match):
            parse_path(bad)
    assert parse_path(["M", "1", "2", "-"]) == [("M", [1, 2])]  # a dangling sign at the end


def test_segment_output_fields_and_parse_error() -> None:
    out = segment_output("dog", [100, 105, 105, 101, 107, 107, 103], [0.5, 0.25, 0.75, 0.75],
                         [(0.5, 0.25), (0.1, 0.1)], decode)
    seg = out["segments"][0]
    assert seg["svg_path"] == seg["coarse_path"] == "M 0 0 L 1 1 Z"
    assert seg["bbox"] == seg["coarse_bbox"] == {"x_min": 0.25, "y_min": 0.125, "x_max": 0.75, "y_max": 0.375}
    assert seg["points"] == [{"x": 0.5, "y": 0.25}, {"x": 0.75, "y": 0.75}]
    assert seg["sizes"] == [{"width": 0.5, "height": 0.25}, {"width": 0.1, "height": 0.1}]
    assert seg["object"] == "dog" and seg["token_ids"] == [100, 105, 105, 101, 107, 107, 103]
    assert "parse_error" not in seg
    bad = segment_output("dog", [100, 112], [], [], decode)["segments"][0]
    assert bad["svg_path"] == "" and "number" in bad["parse_error"] and bad["path_tokens"] == ["M", "oops"]
    assert "bbox" not in bad and "sizes" not in bad and bad["points"] == []
    # the box is clamped to the image, as Kestrel reports it
    assert segment_bbox([0.9, 0.05], [(0.4, 0.2)]) == pytest.approx(
        {"x_min": 0.7, "y_min": 0.0, "x_max": 1.0, "y_max": 0.15})
    assert segment_bbox([0.5], [(0.1, 0.1)]) is None and segment_bbox([0.5, 0.5], []) is None


def test_polylines_commands_and_curves() -> None:
    (sq,) = path_polylines("M 0 0 H 1 V 1 h -1 Z")
    np.testing.assert_allclose(sq, [[0, 0], [1, 0], [1, 1], [0, 1]])
    (rel,) = path_polylines("m 0.5 0.5 l 0.25 0 0 0.25")  # pairs after l repeat it
    np.testing.assert_allclose(rel, [[0.5, 0.5], [0.75, 0.5], [0.75, 0.75]])
    (curve,) = path_polylines("M 0 0 C 0 1 1 1 1 0", curve_steps=4)
    assert len(curve) == 5
    np.testing.assert_allclose(curve[[0, -1]], [[0, 0], [1, 0]])
    np.testing.assert_allclose(curve[2], [0.5, 0.75])  # the cubic's midpoint
    (q,) = path_polylines("M 0 0 Q 0.5 1 1 0 T 2 0", curve_steps=2)
    # T reflects Q's control point
    np.testing.assert_allclose(q, [[0.0, 0.0], [0.5, 0.5], [1.0, 0.0], [1.5, -0.5], [2.0, 0.0]])
    two = path_polylines("M 0 0 L 1 0 L 1 1 Z M 2 2 L 3 3")
    assert [len(p) for p in two] == [3, 2]
    # drawing on after Z without an M: a new subpath from the closed one's start
    (a, b) = path_polylines("M 0 0 L 1 0 L 1 1 Z L 0 1 L -1 1 Z")
    np.testing.assert_allclose(b, [[0.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
    assert len(a) == 3
    with pytest.raises(PathError):
        path_polylines("0 0 L 1 1")


def test_mask_maps_the_path_onto_the_box_with_holes() -> None:
    seg = {"svg_path": "M 0 0 L 1 0 L 1 1 L 0 1 Z M 0.25 0.25 L 0.75 0.25 L 0.75 0.75 L 0.25 0.75 Z",
           "bbox": {"x_min": 0.5, "y_min": 0.0, "x_max": 1.0, "y_max": 0.5}}
    polys = segment_polygons(seg)
    np.testing.assert_allclose(polys[0], [[0.5, 0.0], [1.0, 0.0], [1.0, 0.5], [0.5, 0.5]])
    m = segment_mask(seg, 80, 40)
    assert m.shape == (40, 80)
    assert m[5, 45] and m[15, 75] and not m[10, 60] and not m[30, 45] and not m[5, 20]  # ring: hole in the middle
    assert 0.15 * m.size < m.sum() < 0.22 * m.size  # a quarter of the image less a quarter of that
    assert not segment_mask({"svg_path": "", "bbox": seg["bbox"]}, 8, 8).any()
    with pytest.raises(ValueError):
        segment_mask(seg, 0, 8)


def test_job_segment_transitions() -> None:
    cfg = tiny_config("md3")
    tk = cfg.tokenizer
    job = Job(1, "segment", cfg, Prompt((1, 2, 3)), Settings.from_dict({"max_tokens": 5}, skill="segment"),
              subject="dog")
    assert job.settings.temperature == 0.0 and job.settings.top_p == 1.0  # greedy by default
    spec = job.row_spec(0)
    assert spec.flags == FLAG_SEGMENT and spec.suppressed == ()
    assert not job.can_run_ahead(0)  # the first sample, from the prefill
    assert not job.advance(StepOut(tk.coord_id, 0.0, 0.25, (0.0, 0.0), 0))
    assert (job.next_kind, job.next_value) == (IN_COORD, (0.25, 0.0))
    assert job.can_run_ahead(0) and job.next_input(2) == (IN_TOKEN, 0, (0.0, 0.0), True)  # device rules
    assert not job.advance(StepOut(tk.size_id, 0.0, 0.9, (0.5, 0.125), 0))
    assert (job.next_kind, job.next_value) == (IN_SIZE, (0.5, 0.125))
    assert not job.advance(StepOut(100, 0.0, 0.9, (0.5, 0.125), 0))
    assert (job.next_kind, job.next_token) == (IN_TOKEN, 100)
    assert not job.advance(StepOut(tk.coord_id, 0.0, 0.75, (0.0, 0.0), 0))
    assert job.advance(StepOut(101, 0.0, 0.0, (0.0, 0.0), 0)) and job.finish_reason == "length"  # 5 samples
    assert (job.tokens, job.coords, job.sizes) == ([100, 101], [0.25, 0.75], [(0.5, 0.125)])
    assert job.output_tokens == 5 and job.step_budget() == 5
    seg = job.output(lambda ids: "")["segments"][0]
    assert seg["object"] == "dog" and seg["points"] == [{"x": 0.25, "y": 0.75}]
    stop = Job(2, "segment", cfg, Prompt((1,)), Settings.from_dict(None, skill="segment"))
    assert stop.advance(StepOut(tk.eos_id, 0.0, 0.0, (0.0, 0.0), 0)) and stop.finish_reason == "stop"
    ign = Job(3, "segment", cfg, Prompt((1,)), Settings.from_dict({"ignore_eos": True}, skill="segment"))
    assert ign.row_spec(0).suppressed == (tk.eos_id,)
    assert not ign.advance(StepOut(tk.eos_id, 0.0, 0.0, (0.0, 0.0), 0))
