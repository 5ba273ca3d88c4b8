"""Draw the bundled demo picture, `kestrel_jax/assets/demo.png`, deterministically.

A 640x480 landscape: sky gradient with a sun and two clouds, a horizon over a lake and a meadow,
a red house with a door and windows, a tree, and a blue car on a road. Shapes are drawn at 2x and
downsampled with LANCZOS so edges are smooth; nothing random, so re-running gives the same pixels.

    python tools/make_demo_image.py [--out PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT = 640, 480
_SCALE = 2
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "kestrel_jax" / "assets" / "demo.png"


def _lerp(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    r, g, bl = (round(x + (y - x) * t) for x, y in zip(a, b, strict=True))
    return (r, g, bl)


def make_demo_image() -> Image.Image:
    s = _SCALE
    w, h = WIDTH * s, HEIGHT * s
    horizon = 250 * s
    img = Image.new("RGB", (w, h))
    d = ImageDraw.Draw(img)

    # Sky: vertical gradient down to the horizon; lake band; meadow gradient below.
    for y in range(horizon):
        d.line([(0, y), (w, y)], fill=_lerp((70, 130, 210), (185, 215, 240), y / horizon))
    lake_bottom = 300 * s
    for y in range(horizon, lake_bottom):
        t = (y - horizon) / (lake_bottom - horizon)
        d.line([(0, y), (w, y)], fill=_lerp((60, 110, 170), (90, 140, 190), t))
    for y in range(lake_bottom, h):
        t = (y - lake_bottom) / (h - lake_bottom)
        d.line([(0, y), (w, y)], fill=_lerp((110, 170, 80), (60, 120, 45), t))

    def box(x0: float, y0: float, x1: float, y1: float) -> list[float]:
        return [x0 * s, y0 * s, x1 * s, y1 * s]

    # Distant hills on the horizon.
    d.polygon([(0, horizon), (90 * s, 200 * s), (190 * s, horizon)], fill=(95, 120, 150))
    d.polygon([(140 * s, horizon), (260 * s, 185 * s), (380 * s, horizon)], fill=(110, 135, 165))

    # Sun and clouds.
    d.ellipse(box(520, 40, 590, 110), fill=(255, 215, 60))
    for cx, cy in ((120, 70), (330, 100)):
        for dx, dy, r in ((0, 0, 22), (25, -8, 26), (52, 0, 22), (26, 8, 20)):
            d.ellipse(box(cx + dx - r, cy + dy - r, cx + dx + r, cy + dy + r), fill=(250, 250, 252))

    # Road across the meadow.
    d.polygon([(0, 430 * s), (w, 390 * s), (w, 430 * s), (0, 470 * s)], fill=(85, 85, 90))
    for x in range(20, 640, 80):
        yd = 450 - 40 * (x + 25) / 640
        d.line([(x * s, yd * s), ((x + 40) * s, (yd - 2.5) * s)], fill=(240, 240, 240), width=3 * s)

    # House: walls, roof, door, two windows.
    d.rectangle(box(90, 270, 250, 380), fill=(200, 50, 45))
    d.polygon([(75 * s, 272 * s), (170 * s, 200 * s), (265 * s, 272 * s)], fill=(110, 60, 40))
    d.rectangle(box(155, 320, 185, 380), fill=(90, 55, 30))
    for x0 in (105, 205):
        d.rectangle(box(x0, 295, x0 + 32, 325), fill=(235, 235, 200))
        d.line([(x0 + 16) * s, 295 * s, (x0 + 16) * s, 325 * s], fill=(90, 55, 30), width=2 * s)

    # Tree: trunk and crown.
    d.rectangle(box(335, 300, 355, 390), fill=(110, 75, 40))
    d.ellipse(box(295, 215, 395, 320), fill=(40, 130, 55))

    # Blue car on the road: body, cabin, wheels.
    d.rounded_rectangle(box(430, 380, 560, 418), radius=8 * s, fill=(40, 90, 200))
    d.polygon([(455 * s, 382 * s), (475 * s, 355 * s), (520 * s, 355 * s), (540 * s, 382 * s)],
              fill=(40, 90, 200))
    d.polygon([(465 * s, 380 * s), (480 * s, 361 * s), (515 * s, 361 * s), (530 * s, 380 * s)],
              fill=(190, 220, 240))
    for cx in (460, 530):
        d.ellipse(box(cx - 14, 404, cx + 14, 432), fill=(25, 25, 25))
        d.ellipse(box(cx - 6, 412, cx + 6, 424), fill=(170, 170, 170))

    return img.resize((WIDTH, HEIGHT), resample=Image.Resampling.LANCZOS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    make_demo_image().save(args.out, format="PNG", optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
