"""The segment skill's output: an SVG path outlining the object, and its bounding box.

The model (MD3 family; MOONDREAM.md §7.6) emits a coordinate pair and a size (the object's box
centre and extent, decoded from the hidden states as in detect), then the outline as plain text
tokens: path commands (`M`, `L`, `C`, `Z`, ...) and integers, a negative number as `-` then its
digits, in a 0..960 box *relative to the object's bounding box*; token ids <= 20 are not path
text. `segment_output` turns a request's tokens into the result Kestrel gives (`{"segments":
[{...}]}`, the path scaled to [0, 1] of the box), and `segment_polygons` / `segment_mask` map
that path onto the image, which Kestrel's output leaves to the caller.

Parsing is strict about what a token is (a command, an integer or `-`) and lenient about
arity: a command's numbers are taken in pairs (one at a time for `H`/`V`) and an incomplete
pair at the end is dropped, as Kestrel does; so is a sign with no number after it (a path cut
off by max_tokens keeps what came before). A token that is none of these makes the path
unparseable: the result then has an empty `svg_path` and a `parse_error`, and keeps the raw
tokens. Pure Python + numpy (Pillow for the mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

PATH_COMMANDS = frozenset("MmLlHhVvCcSsQqTtAaZz")
VIEWBOX = 960.0  # the path's coordinate box (relative to the object's bounding box)
_LAST_SPECIAL_ID = 20  # ids up to this are control tokens, never path text
_SINGLE = frozenset("HhVv")  # commands that take one number, not pairs


class PathError(ValueError):
    """An SVG path the model produced cannot be read."""


def path_token_strings(decode: Callable[[list[int]], str], ids: Sequence[int]) -> list[str]:
    """Each path-text id decoded on its own and stripped (empty ones dropped)."""
    out = []
    for i in ids:
        if i > _LAST_SPECIAL_ID:
            text = decode([int(i)]).strip()
            if text:
                out.append(text)
    return out


def parse_path(tokens: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Path token strings -> [(command, its integers)] (see the module note on arity)."""
    cmds: list[tuple[str, list[int]]] = []
    i = 0
    while i < len(tokens):
        cmd = tokens[i]
        if cmd not in PATH_COMMANDS:
            raise PathError(f"expected a path command at token {i}, got {cmd!r}")
        i += 1
        nums: list[int] = []
        while i < len(tokens) and tokens[i] not in PATH_COMMANDS:
            tok, neg = tokens[i], False
            if tok == "-":
                if i + 1 >= len(tokens):  # a dangling sign at the end (cut off by max_tokens)
                    i += 1
                    break
                neg, i = True, i + 1
                tok = tokens[i]
            if not tok.isdigit():
                raise PathError(f"expected a number at token {i}, got {tok!r}")
            nums.append(-int(tok) if neg else int(tok))
            i += 1
        keep = len(nums) if cmd in _SINGLE else len(nums) - len(nums) % 2
        cmds.append((cmd, nums[:keep]))
    return cmds


def _number(v: float) -> str:
    text = f"{v:.3f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def scaled_path(cmds: Sequence[tuple[str, Sequence[int]]]) -> str:
    """The path with its numbers divided by VIEWBOX ([0, 1] of the bounding box), space separated,
    3 decimals at most."""
    return " ".join(" ".join([cmd, *(_number(n / VIEWBOX) for n in nums)]) for cmd, nums in cmds)


def _clamp(v: float) -> float:
    return min(max(float(v), 0.0), 1.0)


def segment_bbox(coords: Sequence[float], sizes: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """The object's box from the first coordinate pair (centre) and the first size, clamped to the
    image; None without them."""
    if len(coords) < 2 or not sizes:
        return None
    cx, cy = _clamp(coords[0]), _clamp(coords[1])
    w, h = _clamp(sizes[0][0]), _clamp(sizes[0][1])
    return {"x_min": max(cx - w / 2, 0.0), "y_min": max(cy - h / 2, 0.0),
            "x_max": min(cx + w / 2, 1.0), "y_max": min(cy + h / 2, 1.0)}


def segment_output(obj: str, text_ids: Sequence[int], coords: Sequence[float],
                   sizes: Sequence[tuple[float, float]], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """A segment request's result: `{"segments": [segment]}` with the segment's `object`, `svg_path`
    (scaled to [0, 1] of `bbox`), `bbox`, `points` (the coordinate pairs), `sizes`, `path_tokens`
    (the decoded token strings), `token_ids` (the text ids), `text` (their plain decoding), and
    `parse_error` when the path cannot be read. `coarse_path` / `coarse_bbox` repeat `svg_path` /
    `bbox` (Kestrel's names for the values before its optional mask refiner, which this engine does
    not run)."""
    tokens = path_token_strings(decode, text_ids)
    seg: dict[str, Any] = {"object": obj, "text": decode(list(text_ids)).strip() if text_ids else ""}
    try:
        path = scaled_path(parse_path(tokens))
    except PathError as e:
        path = ""
        seg["parse_error"] = str(e)
    bbox = segment_bbox(coords, sizes)
    seg.update({"svg_path": path, "path_tokens": tokens, "token_ids": [int(i) for i in text_ids],
                "points": [{"x": _clamp(coords[i]), "y": _clamp(coords[i + 1])} for i in range(0, len(coords) - 1, 2)],
                "coarse_path": path})
    if bbox is not None:
        seg["bbox"] = bbox
        seg["coarse_bbox"] = dict(bbox)
    if sizes:
        seg["sizes"] = [{"width": _clamp(w), "height": _clamp(h)} for w, h in sizes]
    return {"segments": [seg]}


# ------------------------------------------------------------------------------------------------
# The path on the image


def _path_numbers(svg_path: str) -> list[tuple[str, list[float]]]:
    cmds: list[tuple[str, list[float]]] = []
    for tok in svg_path.split():
        if tok in PATH_COMMANDS:
            cmds.append((tok, []))
            continue
        if not cmds:
            raise PathError(f"a path starts with a command, not {tok!r}")
        try:
            cmds[-1][1].append(float(tok))
        except ValueError as e:
            raise PathError(f"not a number in the path: {tok!r}") from e
    return cmds


def _bezier(points: np.ndarray, steps: int) -> list[np.ndarray]:
    """Points along a Bezier curve (control points [k, 2]) after its start, `steps` of them."""
    t = np.linspace(0.0, 1.0, steps + 1)[1:, None]
    n = len(points) - 1
    out = sum(math.comb(n, k) * (1 - t) ** (n - k) * t ** k * points[k] for k in range(n + 1))
    return list(np.asarray(out))


def path_polylines(svg_path: str, curve_steps: int = 8) -> list[np.ndarray]:
    """The path's subpaths as point arrays [n, 2] in the path's own coordinates, curves (C, S, Q, T)
    flattened to `curve_steps` segments each; an arc (A) becomes a line to its end point."""
    subpaths: list[list[np.ndarray]] = []
    cur = np.zeros(2)
    start = np.zeros(2)
    ctrl: np.ndarray | None = None  # the last curve's second control point (S, T reflect it)
    prev = ""
    closed = False  # the last command was Z
    for cmd, nums in _path_numbers(svg_path):
        rel = cmd.islower()
        up = cmd.upper()
        if up == "Z":  # back to the subpath's start; drawing on without an M starts a new subpath there
            cur, closed = start.copy(), True
            ctrl, prev = None, up
            continue
        arity = {"M": 2, "L": 2, "T": 2, "H": 1, "V": 1, "S": 4, "Q": 4, "C": 6, "A": 7}[up]
        for j in range(0, len(nums) - arity + 1, arity):
            a = np.asarray(nums[j: j + arity], float)
            base = cur if rel else np.zeros(2)
            if up == "M" and j == 0:
                cur = base + a
                start = cur.copy()
                subpaths.append([cur.copy()])
                ctrl, prev, closed = None, up, False
                continue
            if not subpaths or closed:
                subpaths.append([cur.copy()])
                closed = False
            if up in ("M", "L"):  # numbers after M's first pair are line-tos
                nxt, ctrl = base + a, None
                pts = [nxt]
            elif up == "H":
                nxt, ctrl = np.asarray([a[0] + (cur[0] if rel else 0.0), cur[1]]), None
                pts = [nxt]
            elif up == "V":
                nxt, ctrl = np.asarray([cur[0], a[0] + (cur[1] if rel else 0.0)]), None
                pts = [nxt]
            elif up == "A":
                nxt, ctrl = base + a[5:7], None
                pts = [nxt]
            elif up == "C":
                c1, c2, nxt = base + a[0:2], base + a[2:4], base + a[4:6]
                pts, ctrl = _bezier(np.stack([cur, c1, c2, nxt]), curve_steps), c2
            elif up == "S":
                c1 = 2 * cur - ctrl if ctrl is not None and prev in ("C", "S") else cur
                c2, nxt = base + a[0:2], base + a[2:4]
                pts, ctrl = _bezier(np.stack([cur, c1, c2, nxt]), curve_steps), c2
            elif up == "Q":
                c1, nxt = base + a[0:2], base + a[2:4]
                pts, ctrl = _bezier(np.stack([cur, c1, nxt]), curve_steps), c1
            else:  # T
                c1 = 2 * cur - ctrl if ctrl is not None and prev in ("Q", "T") else cur
                nxt = base + a[0:2]
                pts, ctrl = _bezier(np.stack([cur, c1, nxt]), curve_steps), c1
            subpaths[-1].extend(pts)
            cur, prev = np.asarray(nxt, float), up
    return [np.stack(sp) for sp in subpaths if len(sp) >= 2]


def segment_polygons(segment: Mapping[str, Any], curve_steps: int = 8) -> list[np.ndarray]:
    """A segment's outline on the image: its subpaths as arrays [n, 2] of (x, y) in [0, 1] of the
    image (the path's [0, 1] box mapped onto `bbox`). Empty when the segment has no path or box."""
    bbox = segment.get("bbox")
    path = segment.get("svg_path") or ""
    if not bbox or not path:
        return []
    lo = np.asarray([bbox["x_min"], bbox["y_min"]], float)
    ext = np.asarray([bbox["x_max"] - bbox["x_min"], bbox["y_max"] - bbox["y_min"]], float)
    return [lo + p * ext for p in path_polylines(path, curve_steps)]


def segment_mask(segment: Mapping[str, Any], width: int, height: int, curve_steps: int = 8) -> np.ndarray:
    """The segment as a boolean mask [height, width] of an image that size: its subpaths filled
    with the even-odd rule (a subpath inside another is a hole)."""
    from PIL import Image, ImageDraw

    if width < 1 or height < 1:
        raise ValueError(f"mask size must be positive, got {width} x {height}")
    mask = np.zeros((height, width), bool)
    for poly in segment_polygons(segment, curve_steps):
        if len(poly) < 3:
            continue
        img = Image.new("1", (width, height), 0)
        xy = [(float(x * width), float(y * height)) for x, y in poly]
        ImageDraw.Draw(img).polygon(xy, fill=1, outline=1)
        mask ^= np.asarray(img, bool)
    return mask
