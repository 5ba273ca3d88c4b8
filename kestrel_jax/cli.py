"""`kestrel-jax` command line: demo, query, caption, detect, point, segment, batch, serve, convert, calibrate-kv.

With no `--model`, commands use a small synthetic Moondream 3 (random weights, generated
deterministically on first use into a cache folder) and, where no image is given, the bundled
demo image: everything runs offline, and the answers are noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEMO_SEED = 20251122
# 2: a 2-layer vision encoder (the demo compiles in seconds, its answers are noise either way); 3: MD3's
# config names its segment template
DEMO_VERSION = 3


def _cache_dir() -> Path:
    root = os.environ.get("KESTREL_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kestrel_jax")
    return Path(root)


def compile_cache_dir(arg: str | None) -> str | None:
    """The compile cache directory of the server and the one-shot commands: the flag's, else
    compile/ in the cache root; 'none': off."""
    if arg is None:
        return str(_cache_dir() / "compile")
    return None if arg.lower() == "none" else arg


def demo_checkpoint(family: str = "md3") -> Path:
    """The synthetic demo checkpoint (tiny config, real tensor names), written once and reused."""
    from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint
    from kestrel_jax.models.config import tiny_config

    out = _cache_dir() / f"demo-tiny-{family}-v{DEMO_VERSION}"
    marker = out / ".complete"
    if not marker.exists():
        print(f"[kestrel-jax] writing the synthetic demo checkpoint to {out} (once)", file=sys.stderr)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write_synthetic_checkpoint(tmp, tiny_config("md3" if family == "md3" else "md2", vision_layers=2),
                                   seed=DEMO_SEED, overwrite=True)
        (tmp / ".complete").write_text("ok\n")
        if out.exists():  # a concurrent writer finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(out)
    return out


def _engine_config(args: argparse.Namespace) -> Any:
    """A one-shot engine: batch buckets up to 8 and lazy compilation (only the shapes a command
    uses are compiled; a server compiles every bucket up front instead), kept in the compile cache
    so that the next command with the same model and shapes loads them."""
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.runner import RunnerConfig

    path = str(args.model) if args.model else str(demo_checkpoint(args.family))
    runner = RunnerConfig(max_seq_len=args.max_seq_len, compilation_cache_dir=compile_cache_dir(args.compile_cache),
                          kv_scales=args.kv_scales)
    return EngineConfig(model_path=path, dtype=args.dtype, runner=runner,
                        decode_buckets=(1, 2, 4, 8), prefill_token_buckets=(128, 1024, 2048), max_prefill_seqs=4,
                        warmup=False)


async def _with_engine(args: argparse.Namespace, body: Any, config: Any = None) -> int:
    from kestrel_jax.serving.engine import InferenceEngine

    t0 = time.perf_counter()
    engine = await InferenceEngine.create(config if config is not None else _engine_config(args))
    if not args.quiet:
        print(f"[kestrel-jax] {engine.cfg.name} ({engine.cfg.family}) ready in {time.perf_counter() - t0:.1f}s "
              f"({engine.stats['kv_dtype']} KV cache, {engine.stats['num_pages']} pages)", file=sys.stderr)
    if not args.model:
        print("[kestrel-jax] NOTE: no --model given; using a small synthetic model with RANDOM weights. "
              "Its answers are noise; pass --model PATH for a real Moondream checkpoint.", file=sys.stderr)
    try:
        await body(engine)
    finally:
        await engine.shutdown()
    return 0


def _run(args: argparse.Namespace, body: Any, config: Any = None) -> int:
    import asyncio

    return asyncio.run(_with_engine(args, body, config))


def _image(args: argparse.Namespace) -> Any:
    from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH

    return Path(args.image) if args.image else DEMO_IMAGE_PATH


def _settings(args: argparse.Namespace, temperature: float) -> dict[str, Any]:
    return {"temperature": temperature if args.temperature is None else args.temperature, "top_p": args.top_p,
            "max_tokens": args.max_tokens, "seed": args.seed}


def _emit(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(payload))
    else:
        for k, v in payload.items():
            print(f"{k}: {v}")


def _payload(res: Any) -> dict[str, Any]:
    m = res.metrics
    return {**res.output, "finish_reason": res.finish_reason,
            "metrics": {"ttft_ms": round(m.ttft_ms, 1), "decode_tok_s": round(m.tokens_per_s, 1),
                        "output_tokens": m.output_tokens, "cached_tokens": m.cached_tokens}}


def cmd_caption(args: argparse.Namespace) -> int:
    async def body(engine: Any) -> None:
        _emit(args, _payload(await engine.caption(_image(args), length=args.length, settings=_settings(args, 0.2))))

    return _run(args, body)


def cmd_query(args: argparse.Namespace) -> int:
    reasoning = None if args.reasoning is None else args.reasoning == "on"

    async def body(engine: Any) -> None:
        image = None if args.no_image else _image(args)
        res = await engine.query(image, args.question, reasoning=reasoning, settings=_settings(args, 0.2))
        out = _payload(res)
        if "reasoning" in out:
            out["reasoning"] = out["reasoning"]["text"]
        _emit(args, out)

    return _run(args, body)


def _region_cmd(args: argparse.Namespace, skill: str) -> int:
    settings = {} if args.max_objects is None else {"max_objects": args.max_objects}

    async def body(engine: Any) -> None:
        fn = engine.detect if skill == "detect" else engine.point
        _emit(args, _payload(await fn(_image(args), args.object, settings=settings)))

    return _run(args, body)


def cmd_detect(args: argparse.Namespace) -> int:
    return _region_cmd(args, "detect")


def cmd_point(args: argparse.Namespace) -> int:
    return _region_cmd(args, "point")


def cmd_segment(args: argparse.Namespace) -> int:
    async def body(engine: Any) -> None:
        res = await engine.segment(_image(args), args.object, settings=_settings(args, 0.0))
        if args.mask:
            from PIL import Image

            from kestrel_jax.models.image_crops import load_image
            from kestrel_jax.segment import segment_mask

            h, w = load_image(_image(args)).shape[:2]
            mask = segment_mask(res.output["segments"][0], w, h)
            Image.fromarray(mask.astype("uint8") * 255).save(args.mask)
        _emit(args, _payload(res))

    return _run(args, body)


def cmd_demo(args: argparse.Namespace) -> int:
    """Every skill on one image, submitted together: the engine batches them, and all but the
    first hit the prefix cache for the image (no second vision pass or 730-token prefill)."""
    import asyncio

    async def body(engine: Any) -> None:
        image = _image(args)
        print(f"[demo] image: {image}")
        s = {"temperature": 0.0, "max_tokens": args.max_tokens}
        objs = {"max_objects": args.max_objects}
        t0 = time.perf_counter()
        first = await engine.caption(image, length="short", settings=s)  # encodes the image once
        t1 = time.perf_counter()
        rest = await asyncio.gather(
            engine.query(image, "What is in this image?", reasoning=False, settings=s),
            engine.query(image, "How many shapes are there?", reasoning=True, settings=s),
            engine.detect(image, "car", settings=objs),
            engine.point(image, "sun", settings=objs),
            *([engine.segment(image, "sun", settings=s)] if engine.cfg.tokenizer.templates.has_segment else []))
        t2 = time.perf_counter()
        names = ["caption (short)", "query", "query (reasoning)", "detect 'car'", "point 'sun'", "segment 'sun'"]
        for name, res in zip(names, [first, *rest], strict=False):
            out = {k: v for k, v in res.output.items()}
            text = next((v for v in out.values() if isinstance(v, str)), None)
            if "segments" in out:
                seg = out["segments"][0]
                text = seg["svg_path"] or f"(no path: {seg.get('parse_error', 'none produced')})"
            shown = repr(text[:100]) if text is not None else out
            print(f"[demo] {name:18s} finish={res.finish_reason:6s} ttft={res.metrics.ttft_ms:7.1f}ms "
                  f"cached={res.metrics.cached_tokens:4d} -> {shown}")
        print(f"[demo] first request {t1 - t0:.2f}s; the other {len(rest)} together {t2 - t1:.2f}s")
        if not args.model:
            print("[demo] (random weights: the text above is noise, by design)")

    return _run(args, body)


IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
_RESULT_KEYS = frozenset({"output", "finish_reason", "metrics", "error"})  # the rest of a line is its request


def _image_paths(inputs: list[str], list_file: str | None) -> Iterator[Path]:
    """Image files named, those under named folders (recursively, by suffix, in sorted order:
    folders are walked as the job goes, never listed whole), then those a list file names (one
    path a line, '-' for standard input; blank lines and '#' comments skipped). A named path that
    does not exist is yielded as it is: its request fails alone, with the reason."""
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for f in sorted(files):
                    if Path(f).suffix.lower() in IMAGE_SUFFIXES:
                        yield Path(root) / f
        else:
            yield path
    if list_file is not None:
        stream = sys.stdin if list_file == "-" else open(list_file, encoding="utf-8")  # noqa: SIM115
        try:
            for line in stream:
                line = line.strip()
                if line and not line.startswith("#"):
                    yield Path(line)
        finally:
            if stream is not sys.stdin:
                stream.close()


def _batch_requests(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The job's requests as JSON-ready dicts (image paths as strings), read lazily."""
    if args.requests:
        with open(args.requests, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    req = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BatchInputError(f"{args.requests}:{n}: not a JSON object: {e}") from e
                if not isinstance(req, dict) or not isinstance(req.get("skill"), str):
                    raise BatchInputError(f"{args.requests}:{n}: each line is a JSON object with a 'skill'")
                yield req
        return
    extra: dict[str, Any] = {}
    if args.skill == "query":
        extra["question"] = args.question
        if args.reasoning is not None:
            extra["reasoning"] = args.reasoning == "on"
    elif args.skill == "caption":
        extra["length"] = args.length
    else:
        extra["object"] = args.object
    names = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens, "seed": args.seed,
             "max_objects": args.max_objects}
    settings = {k: v for k, v in names.items() if v is not None}
    for path in _image_paths(args.inputs, args.list):
        yield {"skill": args.skill, "image": str(path), **extra, **({"settings": settings} if settings else {})}


def _request_key(req: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in req.items() if k not in _RESULT_KEYS}, sort_keys=True, default=str)


def _done_keys(out: Path) -> set[str]:
    """Requests an earlier run of the job finished (lines without an error; a torn last line is
    ignored: it is run again)."""
    done: set[str] = set()
    with open(out, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "output" in rec and "error" not in rec:
                done.add(_request_key(rec))
    return done


def _error_type(e: BaseException) -> str:
    from kestrel_jax.errors import user_errors
    from kestrel_jax.serving.engine import EngineBusy

    if isinstance(e, EngineBusy):  # more in flight than the engine holds: --resume runs it again
        return "overloaded"
    if isinstance(e, user_errors()):
        name = type(e).__name__
        return {"ImageError": "invalid_image", "PromptError": "invalid_prompt", "SettingsError": "invalid_settings",
                "RequestRejected": "request_rejected", "FileNotFoundError": "not_found"}.get(name, "invalid_request")
    if isinstance(e, ValueError | TypeError):  # a request's own arguments: an unknown skill or keyword
        return "invalid_request"
    return "internal_error"


def cmd_batch(args: argparse.Namespace) -> int:
    """One skill over many images, or a JSONL of requests: a JSON line per request, written as
    each ends (completion order), resumable."""
    from tqdm import tqdm

    from kestrel_jax.serving.engine import EngineError

    out = Path(args.out)
    done = _done_keys(out) if out.exists() else set()
    if out.exists() and out.stat().st_size:
        with open(out, "rb+") as f:  # a line torn by a killed run: end it, so the next line starts clean
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    counts = {"ok": 0, "failed": 0, "skipped": 0}

    def todo() -> Iterator[dict[str, Any]]:
        for req in _batch_requests(args):
            if _request_key(req) in done:
                counts["skipped"] += 1
                continue
            yield req

    def engine_request(req: dict[str, Any]) -> dict[str, Any]:
        r = dict(req)
        if isinstance(r.get("image"), str):
            r["image"] = Path(r["image"])
        return r

    async def body(engine: Any) -> None:
        t0 = time.perf_counter()
        as_written: dict[int, dict[str, Any]] = {}  # in flight: index -> the request as the job names it

        def submitted() -> Iterator[dict[str, Any]]:
            for i, req in enumerate(todo()):
                as_written[i] = req
                yield engine_request(req)

        with open(out, "a", encoding="utf-8") as f, tqdm(desc="batch", unit="req", disable=args.quiet,
                                                         file=sys.stderr) as bar:
            stream = engine.generate_stream(submitted(), max_in_flight=args.max_in_flight)
            async for i, _, res in stream:
                rec = dict(as_written.pop(i))
                if isinstance(res, EngineError):
                    raise res  # the engine stopped: the lines so far are kept, --resume goes on
                if isinstance(res, BaseException):
                    rec["error"] = {"type": _error_type(res), "message": str(res) or type(res).__name__}
                    counts["failed"] += 1
                else:
                    m = res.metrics
                    rec.update(output=res.output, finish_reason=res.finish_reason,
                               metrics={"ttft_ms": round(m.ttft_ms, 1), "output_tokens": m.output_tokens,
                                        "cached_tokens": m.cached_tokens})
                    counts["ok"] += 1
                f.write(json.dumps(rec, default=str) + "\n")
                f.flush()
                bar.update(1)
        dt = time.perf_counter() - t0
        n = counts["ok"] + counts["failed"]
        print(f"[kestrel-jax] batch: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} already done "
              f"in {out}; {n / dt if dt > 0 else 0.0:.2f} req/s", file=sys.stderr)

    try:
        _run(args, body, config=_batch_engine_config(args))
    except EngineError as e:
        print(f"kestrel-jax batch: error: the engine stopped ({e}); the results so far are in {out}: run the "
              "same command with --resume to go on", file=sys.stderr)
        return 2
    return 1 if counts["failed"] else 0


def _batch_engine_config(args: argparse.Namespace) -> Any:
    """Throughput buckets (decode up to --max-batch-size), compiled lazily as the job meets them."""
    from kestrel_jax.serving.engine import decode_buckets_up_to

    cfg = _engine_config(args)
    return dataclasses.replace(cfg, decode_buckets=decode_buckets_up_to(args.max_batch_size),
                               prefill_token_buckets=type(cfg)().prefill_token_buckets,
                               max_prefill_seqs=type(cfg)().max_prefill_seqs, num_devices=args.num_devices)


class BatchInputError(ValueError):
    """The batch job's own input is wrong (its arguments, its request file): nothing of it runs
    past that point."""


def _check_batch_args(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists() and not args.resume:
        raise BatchInputError(f"{out} exists: pass --resume to continue that job (requests with a result there are "
                              "skipped, failed ones run again), or choose another --out")
    if args.max_in_flight < 1 or args.max_batch_size < 1:
        raise BatchInputError("--max-in-flight and --max-batch-size must be >= 1")
    for flag, name in (("--requests", args.requests), ("--list", args.list)):
        if name is not None and name != "-" and not Path(name).is_file():
            raise BatchInputError(f"{flag} {name}: no such file")
    if args.requests:
        if args.inputs or args.list or args.skill:
            raise BatchInputError("--requests takes its skills and images from the file: no --skill, inputs or --list")
        return
    if not args.skill:
        raise BatchInputError("name a --skill (query, caption, detect, point, segment), or pass --requests "
                              "FILE.jsonl")
    if not args.inputs and args.list is None:
        raise BatchInputError("no images: name image files or folders, or pass --list FILE")
    if args.skill == "query" and not args.question:
        raise BatchInputError("--skill query needs --question")
    if args.skill in ("detect", "point", "segment") and not args.object:
        raise BatchInputError(f"--skill {args.skill} needs --object")


def cmd_convert(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from kestrel_jax.models.loader import convert_checkpoint

    fp8 = {"keep": None, "on": True, "off": False}[args.fp8_experts]
    t = convert_checkpoint(args.src, args.dst, fp8_experts=fp8, overwrite=args.overwrite,
                           dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
    print(f"converted {args.src} -> {args.dst}: load {t['load_s']:.1f}s, save {t['save_s']:.1f}s")
    return 0


def cmd_calibrate_kv(args: argparse.Namespace) -> int:
    """Per-layer K/V scales for an FP8 KV cache, measured on sample requests (kestrel_jax/kv_scales.py)."""
    import itertools

    import jax.numpy as jnp

    from kestrel_jax import kv_scales
    from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH, ImageError, load_image
    from kestrel_jax.models.loader import load_model
    from kestrel_jax.tokenizer import Tokenizer

    if args.max_tokens < 1 or args.max_images < 1:
        raise BatchInputError("--max-tokens and --max-images must be >= 1")
    if not (args.headroom >= 1.0 and args.headroom < float("inf")):
        raise BatchInputError(f"--headroom must be a finite number >= 1, got {args.headroom}")
    path = Path(args.model) if args.model else demo_checkpoint(args.family)
    images: list[Any] = []
    for f in itertools.islice(_image_paths(args.inputs, args.list), args.max_images):
        try:
            images.append(load_image(f))
        except (ImageError, OSError) as e:  # one unreadable image is skipped, not the job
            print(f"[calibrate-kv] skipped {f}: {e}", file=sys.stderr)
    if not images:
        if args.inputs or args.list:
            raise BatchInputError("none of the given images could be read")
        images = [load_image(DEMO_IMAGE_PATH)]
    questions = args.question or list(kv_scales.DEFAULT_QUESTIONS)
    samples = [kv_scales.Sample(im, q) for im in images for q in questions]
    samples += [] if args.no_caption else [kv_scales.Sample(im) for im in images]
    model = load_model(path, dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16, progress=not args.quiet)
    tok = Tokenizer.from_dir(path)
    t0 = time.perf_counter()
    calib = kv_scales.calibrate(model, tok, samples, max_tokens=args.max_tokens, headroom=args.headroom)
    out = kv_scales.save(args.out, calib, model_name=model.cfg.name)
    summary: dict[str, Any] = {
        "out": str(out), "model": model.cfg.name, "layers": int(calib.scales.shape[0]), "samples": calib.samples,
        "positions": calib.positions, "seconds": round(time.perf_counter() - t0, 1),
        "k_scale": [float(calib.scales[:, 0].min()), float(calib.scales[:, 0].max())],
        "v_scale": [float(calib.scales[:, 1].min()), float(calib.scales[:, 1].max())]}
    if args.compare:
        summary["compare"] = kv_scales.compare(model, tok, samples, calib.scales, max_tokens=args.max_tokens)
    print(json.dumps(summary))
    if not args.model:
        print("[kestrel-jax] NOTE: no --model given; these scales are for the synthetic demo model.", file=sys.stderr)
    return 0


def api_key(args: argparse.Namespace) -> str | None:
    """The server's API key: --api-key, else $KESTREL_JAX_API_KEY, else none."""
    return args.api_key or os.environ.get("KESTREL_JAX_API_KEY") or None


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
        ecfg = engine_config(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, kv_scales=args.kv_scales,
                             page_size=args.page_size,
                             max_batch_size=args.max_batch_size, prefix_cache=not args.no_prefix_cache,
                             compile_cache=compile_cache_dir(args.compile_cache),
                             max_queued=None if args.max_queued < 0 else args.max_queued,
                             num_devices=args.num_devices)
        scfg = ServerConfig(host=args.host, port=args.port, max_body_bytes=int(args.max_request_mb * 2**20),
                            request_timeout_s=args.request_timeout, shutdown_grace_s=args.shutdown_grace,
                            model_name=Path(args.model).name if args.model else None,
                            synthetic=not args.model,
                            api_key=api_key(args)).validate()
    except ValueError as e:
        print(f"kestrel-jax serve: error: {e}", file=sys.stderr)
        return 2
    run(ecfg, scfg)
    return 0


KV_SCALES_HELP = ("per-layer K/V scales file from `kestrel-jax calibrate-kv`, in place of the checkpoint's; "
                  "with --kv-dtype auto it turns the FP8 KV cache on on a GPU")


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
        p.add_argument("--max-seq-len", type=int, default=None, help="context (default: the model's)")
        p.add_argument("--kv-scales", default=None, help=KV_SCALES_HELP)
        p.add_argument("--json", action="store_true")
        p.add_argument("--quiet", action="store_true")
        p.add_argument("--compile-cache", default=None,
                       help="compiled-step cache directory, so the next command skips compiling (default: "
                            "compile/ in $KESTREL_JAX_CACHE or ~/.cache/kestrel_jax; 'none': no cache)")

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
    p = sub.add_parser("segment", help="the object's outline as an SVG path and its box (Moondream 3 family)")
    common(p)
    p.add_argument("object")
    p.add_argument("--mask", help="also write the outline as a PNG mask of the image's size to this path")
    p.set_defaults(fn=cmd_segment, max_tokens=768, top_p=1.0)
    p = sub.add_parser("batch", help="one skill over many images (files, folders, a list) or a JSONL of requests; "
                                     "a JSON line per request, resumable")
    common(p, image=False)
    p.add_argument("inputs", nargs="*", help="image files, or folders searched recursively for images")
    p.add_argument("--skill", choices=["query", "caption", "detect", "point", "segment"])
    p.add_argument("--question", help="--skill query: the question")
    p.add_argument("--reasoning", choices=["on", "off"], default=None, help="--skill query")
    p.add_argument("--length", choices=["short", "normal", "long"], default="normal", help="--skill caption")
    p.add_argument("--object", help="--skill detect / point / segment: what to find")
    p.add_argument("--list", help="a file of image paths, one a line ('-': standard input)")
    p.add_argument("--requests", help="JSONL, one request a line: {\"skill\": ..., \"image\": path, ...} "
                                      "with the skill's arguments and optional \"settings\"")
    p.add_argument("--out", required=True, help="the results, JSON lines (appended to with --resume)")
    p.add_argument("--resume", action="store_true", help="continue a job: skip requests --out has a result for")
    p.add_argument("--max-in-flight", type=int, default=256, help="requests submitted at a time")
    p.add_argument("--max-batch-size", type=int, default=64, help="largest decode bucket")
    p.add_argument("--num-devices", type=int, default=1, help="local devices to run on, one engine each (0: all)")
    p.set_defaults(fn=cmd_batch, max_tokens=None, top_p=None, seed=None)
    p = sub.add_parser("calibrate-kv", help="measure per-layer K/V scales for an FP8 KV cache on sample "
                                            "requests (MD2 checkpoints carry none); serve with --kv-scales FILE")
    p.add_argument("inputs", nargs="*", help="images, or folders searched for images (default: the bundled one)")
    p.add_argument("--model", help="checkpoint directory (HF safetensors or converted); default: synthetic")
    p.add_argument("--family", choices=["md2", "md3"], default="md2", help="synthetic model family")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--list", help="a file of image paths, one a line ('-': standard input)")
    p.add_argument("--max-images", type=int, default=32, help="images used at most")
    p.add_argument("--question", action="append", help="a question asked of every image (repeatable; default: "
                                                        "three generic ones)")
    p.add_argument("--no-caption", action="store_true", help="no caption request per image")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per request")
    p.add_argument("--headroom", type=float, default=2.0, help="scale = largest |K| or |V| x headroom / 448")
    p.add_argument("--compare", action="store_true",
                   help="also answer the samples with the FP8 cache and count answers identical to the bf16 cache's")
    p.add_argument("--out", required=True, help="the scales file (JSON)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_calibrate_kv)
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
    p.add_argument("--kv-scales", default=None, help=KV_SCALES_HELP)
    p.add_argument("--page-size", type=int, default=64, help="KV cache page size (tokens)")
    p.add_argument("--max-batch-size", type=int, default=None, help="largest decode bucket (default 64)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable image/prompt prefix sharing")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ endpoints (default: $KESTREL_JAX_API_KEY; "
                        "unset: no key). The environment variable keeps the key off the process list")
    p.add_argument("--max-queued", type=int, default=1024,
                   help="requests held beyond those running before new ones get 503 overloaded (-1: no limit)")
    p.add_argument("--num-devices", type=int, default=1,
                   help="serve on this many local devices, one engine each (0: all of them)")
    p.add_argument("--max-request-mb", type=float, default=20.0, help="largest accepted request body")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request fails (504)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM")
    p.add_argument("--compile-cache", default=None,
                   help="compiled-step cache directory, so a restart skips compiling (default: compile/ in "
                        "$KESTREL_JAX_CACHE or ~/.cache/kestrel_jax; 'none': no cache)")
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "fn", None) is None:
        build_parser().print_help()
        return 2
    from kestrel_jax.errors import user_errors

    try:
        if args.fn is cmd_batch:
            _check_batch_args(args)
        return int(args.fn(args))
    except BatchInputError as e:
        print(f"kestrel-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except user_errors() as e:
        print(f"kestrel-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
