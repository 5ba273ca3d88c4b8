"""`kestrel-jax` command line: demo, query, caption, detect, point, convert.

With no `--model`, commands use a small synthetic Moondream 3 (random weights, generated
deterministically on first use into a cache folder) and, where no image is given, the bundled
demo image: everything runs offline, and the answers are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DEMO_SEED = 20251122
DEMO_VERSION = 1


def _cache_dir() -> Path:
    root = os.environ.get("KESTREL_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kestrel_jax")
    return Path(root)


def demo_checkpoint(family: str = "md3") -> Path:
    """The synthetic demo checkpoint (tiny config, real tensor names), written once and reused."""
    from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint
    from kestrel_jax.models.config import tiny_config

    out = _cache_dir() / f"demo-tiny-{family}-v{DEMO_VERSION}"
    marker = out / ".complete"
    if not marker.exists():
        print(f"[kestrel-jax] writing the synthetic demo checkpoint to {out} (once)", file=sys.stderr)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write_synthetic_checkpoint(tmp, tiny_config("md3" if family == "md3" else "md2"), seed=DEMO_SEED,
                                   overwrite=True)
        (tmp / ".complete").write_text("ok\n")
        if out.exists():  # a concurrent writer finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(out)
    return out


def _load(args: argparse.Namespace) -> Any:
    import jax.numpy as jnp

    from kestrel_jax.reference import ReferenceMoondream

    path = Path(args.model) if args.model else demo_checkpoint(args.family)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    t0 = time.perf_counter()
    md = ReferenceMoondream.from_checkpoint(path, dtype=dtype, progress=not args.quiet)
    if not args.quiet:
        print(f"[kestrel-jax] loaded {md.cfg.name} ({md.cfg.family}) from {path} in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if not args.model:
        print("[kestrel-jax] NOTE: no --model given; using a small synthetic model with RANDOM weights. "
              "Its answers are noise; pass --model PATH for a real Moondream checkpoint.", file=sys.stderr)
    return md


def _image(args: argparse.Namespace) -> Any:
    from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH

    return Path(args.image) if args.image else DEMO_IMAGE_PATH


def _settings(args: argparse.Namespace, temperature: float) -> Any:
    from kestrel_jax.generate import SamplingSettings

    t = temperature if args.temperature is None else args.temperature
    return SamplingSettings(temperature=t, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed).validate()


def _emit(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(payload))
    else:
        for k, v in payload.items():
            print(f"{k}: {v}")


def cmd_caption(args: argparse.Namespace) -> int:
    md = _load(args)
    r = md.caption(_image(args), args.length, _settings(args, 0.2))
    _emit(args, {"caption": r.output, "finish_reason": r.finish_reason, "tokens": len(r.tokens)})
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    md = _load(args)
    reasoning = None if args.reasoning is None else args.reasoning == "on"
    image = None if args.no_image else _image(args)
    r = md.query(image, args.question, reasoning=reasoning, settings=_settings(args, 0.2))
    out = {"answer": r.output, "finish_reason": r.finish_reason, "tokens": len(r.tokens)}
    if "reasoning" in r.extra:
        out["reasoning"] = r.extra["reasoning"]["text"]
    _emit(args, out)
    return 0


def cmd_detect(args: argparse.Namespace) -> int:
    md = _load(args)
    r = md.detect(_image(args), args.object, max_objects=args.max_objects)
    _emit(args, {"objects": r.output, "finish_reason": r.finish_reason})
    return 0


def cmd_point(args: argparse.Namespace) -> int:
    md = _load(args)
    r = md.point(_image(args), args.object, max_objects=args.max_objects)
    _emit(args, {"points": r.output, "finish_reason": r.finish_reason})
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kestrel_jax.generate import SamplingSettings

    md = _load(args)
    image = _image(args)
    print(f"[demo] image: {image}")
    t0 = time.perf_counter()
    enc = md.encode_image(image)
    print(f"[demo] vision: {enc.n_crops} crops, tiling {enc.tiling}, {time.perf_counter() - t0:.2f}s")
    s = SamplingSettings(temperature=0.0, max_tokens=args.max_tokens)
    runs = [
        ("caption (short)", lambda: md.caption(enc, "short", s)),
        ("query", lambda: md.query(enc, "What is in this image?", reasoning=False, settings=s)),
        ("query (reasoning)", lambda: md.query(enc, "How many shapes are there?", reasoning=True,
                                               settings=s)),
        ("detect 'car'", lambda: md.detect(enc, "car", max_objects=args.max_objects)),
        ("point 'sun'", lambda: md.point(enc, "sun", max_objects=args.max_objects)),
    ]
    for name, fn in runs:
        t = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t
        out = r.output if not isinstance(r.output, str) else repr(r.output[:120])
        print(f"[demo] {name:18s} {dt:6.2f}s  finish={r.finish_reason:6s} -> {out}")
    if not args.model:
        print("[demo] (random weights: the text above is noise, by design)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from kestrel_jax.models.loader import convert_checkpoint

    fp8 = {"keep": None, "on": True, "off": False}[args.fp8_experts]
    t = convert_checkpoint(args.src, args.dst, fp8_experts=fp8, overwrite=args.overwrite,
                           dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
    print(f"converted {args.src} -> {args.dst}: load {t['load_s']:.1f}s, save {t['save_s']:.1f}s")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    try:
        from kestrel_jax.serving.server import ServerConfig, engine_config, run
    except ModuleNotFoundError as e:
        if e.name != "aiohttp":
            raise
        print("kestrel-jax serve: error: the HTTP server needs aiohttp: pip install 'kestrel-jax[server]'",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ecfg = engine_config(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, page_size=args.page_size,
                             max_batch_size=args.max_batch_size, prefix_cache=not args.no_prefix_cache)
        scfg = ServerConfig(host=args.host, port=args.port, max_body_bytes=int(args.max_request_mb * 2**20),
                            request_timeout_s=args.request_timeout, shutdown_grace_s=args.shutdown_grace,
                            model_name=Path(args.model).name if args.model else None,
                            synthetic=not args.model).validate()
    except ValueError as e:
        print(f"kestrel-jax serve: error: {e}", file=sys.stderr)
        return 2
    run(ecfg, scfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kestrel-jax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command")

    def common(p: argparse.ArgumentParser, image: bool = True) -> None:
        p.add_argument("--model", help="checkpoint directory (HF safetensors or converted); default: synthetic")
        p.add_argument("--family", choices=["md2", "md3"], default="md3", help="synthetic model family")
        p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
        if image:
            p.add_argument("--image", help="image file; default: the bundled demo image")
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--max-objects", type=int, default=None)
        p.add_argument("--temperature", type=float, default=None)
        p.add_argument("--top-p", type=float, default=0.9)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", action="store_true")
        p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("demo", help="run every skill on the bundled image")
    common(p)
    p.set_defaults(fn=cmd_demo, max_objects=3)
    p = sub.add_parser("caption")
    common(p)
    p.add_argument("--length", choices=["short", "normal", "long"], default="normal")
    p.set_defaults(fn=cmd_caption)
    p = sub.add_parser("query")
    common(p)
    p.add_argument("question")
    p.add_argument("--reasoning", choices=["on", "off"], default=None)
    p.add_argument("--no-image", action="store_true", help="text-only query")
    p.set_defaults(fn=cmd_query)
    for name, fn in (("detect", cmd_detect), ("point", cmd_point)):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("object")
        p.set_defaults(fn=fn)
    p = sub.add_parser("convert", help="HF safetensors -> converted (orbax) checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--fp8-experts", choices=["keep", "on", "off"], default="keep")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("serve", help="HTTP server (JSON / Server-Sent Events) over the batched engine")
    p.add_argument("--model", help="checkpoint directory; default: the synthetic demo model (random weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--kv-dtype", choices=["auto", "bf16", "fp8", "f32"], default="auto")
    p.add_argument("--page-size", type=int, default=64, help="KV cache page size (tokens)")
    p.add_argument("--max-batch-size", type=int, default=None, help="largest decode bucket (default 64)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable image/prompt prefix sharing")
    p.add_argument("--max-request-mb", type=float, default=20.0, help="largest accepted request body")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request fails (504)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM")
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "fn", None) is None:
        build_parser().print_help()
        return 2
    from kestrel_jax.errors import user_errors

    try:
        return int(args.fn(args))
    except user_errors() as e:
        print(f"kestrel-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
