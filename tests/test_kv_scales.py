"""Per-layer K/V scales for the FP8 KV cache (kestrel_jax/kv_scales.py): the file and its checks,
calibration against the K/V values the model computes, the runner and engine reading a scales
file, and the `calibrate-kv` command."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax import cli, kv_scales
from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.generate import ReferenceGenerator, SamplingSettings
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import MoondreamModel, random_model
from kestrel_jax.pallas.paged_attention import FP8_MAX
from kestrel_jax.prompts import query_prompt
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.runner import Runner, RunnerConfig
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer


@pytest.fixture(scope="module")
def tiny() -> tuple[MoondreamModel, Tokenizer]:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=21)
    return model, Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (280, 330, 3), dtype=np.uint8)


def _calib(scales: np.ndarray) -> kv_scales.Calibration:
    return kv_scales.Calibration(scales, scales * FP8_MAX / 2.0, 2.0, 3, 2000)


# ----------------------------------------------------------------------------------- the file
def test_scales_from_amax() -> None:
    amax = np.asarray([[448.0, 2.0], [0.0, 0.5]], np.float32)
    got = kv_scales.scales_from_amax(amax, headroom=2.0)
    np.testing.assert_allclose(got, [[2.0, 4.0 / 448], [1.0, 1.0 / 448]], rtol=1e-7)  # no value: 1.0
    assert got.dtype == np.float32
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="headroom"):
            kv_scales.scales_from_amax(amax, bad)
    for bad_amax in (np.ones((3,), np.float32), np.asarray([[1.0, -1.0]]), np.asarray([[np.nan, 1.0]])):
        with pytest.raises(ValueError, match="amax"):
            kv_scales.scales_from_amax(bad_amax)


def test_save_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    scales = rng.uniform(1e-4, 3.0, (5, 2)).astype(np.float32)
    path = kv_scales.save(tmp_path / "sub" / "kv.json", _calib(scales), model_name="m")
    np.testing.assert_array_equal(kv_scales.load(path, 5), scales)  # exact: float32 through JSON
    doc = json.loads(path.read_text())
    assert doc["format"] == kv_scales.FORMAT and doc["n_layers"] == 5 and doc["model"] == "m"
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("edit, match", [
    (None, "no such KV scales file"),
    ("not json {", "not JSON"),
    ({"format": "other"}, "not a KV scales file"),
    ({"version": 99}, "version 99"),
    ({"k_scale": [1.0, 1.0]}, "k_scale has 2 entries; the model has 3 layers"),
    ({"v_scale": "1.0"}, "v_scale has str entries"),
    ({"k_scale": [1.0, 0.0, 1.0]}, r"k_scale\[1\] = 0.0"),
    ({"v_scale": [1.0, 1.0, -2.0]}, r"v_scale\[2\] = -2.0"),
    ({"k_scale": [1.0, "0.5", 1.0]}, r"k_scale\[1\] = '0.5'"),
    ({"k_scale": [1.0, float("nan"), 1.0]}, r"k_scale\[1\] = nan"),
    ({"v_scale": [1.0, True, 1.0]}, r"v_scale\[1\] = True"),
    ({"k_scale": [1.0, [1.0], 1.0]}, r"k_scale\[1\] = \[1.0\]"),
])
def test_load_refuses_bad_files(tmp_path: Path, edit: object, match: str) -> None:
    path = tmp_path / "kv.json"
    if edit is not None:
        kv_scales.save(path, _calib(np.ones((3, 2), np.float32)))
        if isinstance(edit, str):
            path.write_text(edit)
        else:
            assert isinstance(edit, dict)
            path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(CheckpointError, match=match):
        kv_scales.load(path, 3)


def test_apply_checks_the_shape(tiny: tuple[MoondreamModel, Tokenizer]) -> None:
    model, _ = tiny
    with pytest.raises(CheckpointError, match="shape"):
        kv_scales.apply(model, np.ones((model.cfg.text.n_layers + 1, 2), np.float32))


# ------------------------------------------------------------------------------ calibration
def test_calibration_measures_the_models_k_and_v(tiny: tuple[MoondreamModel, Tokenizer]) -> None:
    """With one generated token (sampled from the prefill, never fed) the cache holds the prefill's
    K and V only: the calibration's amax must be the largest |K|, |V| the model computes for the
    image prefix and the prompt, taken here from the layers' captures."""
    model, tok = tiny
    im, q = _image(1), "What is this?"
    calib = kv_scales.calibrate(model, tok, [kv_scales.Sample(im, q)], max_tokens=1, headroom=1.5)
    ref = ReferenceMoondream(model, tok)
    gen = ReferenceGenerator(model)
    seq = gen.new_sequence()
    a = gen.prefill_image(seq, ref.encode_image(im).tokens, capture=True)
    prompt = query_prompt(model.cfg, tok.encode, q, reasoning=False)
    b = gen.feed(seq, gen.prompt_embeddings(prompt.ids), capture=True)
    want = np.asarray([[max(float(jnp.max(jnp.abs(c[kv]))) for c in (a.captures[i], b.captures[i]))
                        for kv in ("k", "v")] for i in range(model.cfg.text.n_layers)], np.float32)
    np.testing.assert_array_equal(calib.amax, want)
    assert calib.positions == seq.length and calib.samples == 1
    np.testing.assert_allclose(calib.scales, want * 1.5 / FP8_MAX, rtol=1e-6)


def test_calibration_covers_generated_positions_and_every_sample(tiny: tuple[MoondreamModel, Tokenizer]) -> None:
    model, tok = tiny
    one = kv_scales.calibrate(model, tok, [kv_scales.Sample(_image(1), "What is this?")], max_tokens=6)
    two = kv_scales.calibrate(model, tok, [kv_scales.Sample(_image(1), "What is this?"), kv_scales.Sample(_image(2))],
                              max_tokens=6)
    assert two.samples == 2 and two.positions > one.positions
    assert np.all(two.amax >= one.amax) and np.all(one.amax > 0)
    with pytest.raises(ValueError, match="no calibration samples"):
        kv_scales.calibrate(model, tok, [], max_tokens=2)


def test_compare_counts_identical_answers_and_restores_the_scales(tiny: tuple[MoondreamModel, Tokenizer]) -> None:
    model, tok = tiny
    samples = [kv_scales.Sample(_image(4), "What is this?"), kv_scales.Sample(_image(5))]
    calib = kv_scales.calibrate(model, tok, samples, max_tokens=6)
    before = np.asarray(model.text.kv_scales[...]).copy()
    good = kv_scales.compare(model, tok, samples, calib.scales, max_tokens=6)
    assert good["samples"] == 2 and good["calibrated"]["identical"] == 2
    assert good["calibrated"]["mean_agreeing_share"] == 1.0
    # scales 1e-6 clip every K and V to +-4.5e-4: attention sees no keys, the answers change
    assert set(good) == {"samples", "max_tokens", "calibrated", "unit"}
    bad = kv_scales.compare(model, tok, samples, np.full_like(calib.scales, 1e-6), max_tokens=6, unit=False)
    assert bad["calibrated"]["identical"] < 2 and bad["calibrated"]["mean_agreeing_share"] < 1.0
    assert "unit" not in bad
    np.testing.assert_array_equal(np.asarray(model.text.kv_scales[...]), before)


# --------------------------------------------------------------------- runner, engine, command
def test_runner_reads_the_scales_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=22)
    n = model.cfg.text.n_layers
    scales = np.linspace(0.01, 0.5, 2 * n, dtype=np.float32).reshape(n, 2)
    path = kv_scales.save(tmp_path / "kv.json", _calib(scales))
    cfg = RunnerConfig(num_pages=8, max_seq_len=256, vision_buckets=(2,), kv_scales=str(path))
    with caplog.at_level("WARNING", logger="kestrel_jax.serving.runner"):
        runner = Runner(model, cfg, out_rows=2)
    np.testing.assert_array_equal(np.asarray(runner.cache.k_scale), scales[:, 0])
    np.testing.assert_array_equal(np.asarray(runner.cache.v_scale), scales[:, 1])
    assert runner.kv_dtype == model.dtype  # "auto" on a CPU: the model's dtype, scales or not
    assert "has no effect: the KV cache is float32" in caplog.text  # said, not silently ignored
    caplog.clear()
    with caplog.at_level("WARNING", logger="kestrel_jax.serving.runner"):
        fp8 = Runner(model, dataclasses.replace(cfg, kv_dtype="fp8"), out_rows=2)
    assert fp8.kv_dtype == jnp.float8_e4m3fn and "has no effect" not in caplog.text
    with pytest.raises(CheckpointError, match="2 entries; the model has"):
        kv_scales.save(path, _calib(scales[:2]))
        Runner(model, cfg, out_rows=2)


def test_engine_with_a_scales_file_answers_as_the_reference_fp8_path(
        tiny: tuple[MoondreamModel, Tokenizer], tmp_path: Path) -> None:
    model, tok = tiny
    saved = np.asarray(model.text.kv_scales[...]).copy()
    samples = [kv_scales.Sample(_image(6), "What is this?")]
    calib = kv_scales.calibrate(model, tok, samples, max_tokens=4)
    path = kv_scales.save(tmp_path / "kv.json", calib)
    cfg = EngineConfig(runner=RunnerConfig(num_pages=32, kv_dtype="fp8", max_seq_len=1024, vision_buckets=(2,),
                                           kv_scales=str(path)),
                       decode_buckets=(1, 2), prefill_token_buckets=(1024,), max_prefill_seqs=2, warmup=False)
    images = [_image(7), _image(8)]

    async def run() -> list[Result]:
        eng = await InferenceEngine.create(cfg, model=model, tokenizer=tok)
        try:
            outs = await asyncio.gather(*[eng.query(im, "What is this?", reasoning=False,
                                                    settings={"temperature": 0.0, "max_tokens": 8}) for im in images])
            assert eng.stats["kv_dtype"] == "float8_e4m3fn" and eng.stats["kv_scales"] == str(path)
            return [o for o in outs if isinstance(o, Result)]
        finally:
            await eng.shutdown()

    try:
        results = asyncio.run(run())
        np.testing.assert_array_equal(np.asarray(model.text.kv_scales[...]), calib.scales)
        ref = ReferenceMoondream(model, tok)
        ref.gen = ReferenceGenerator(model, kv_dtype=jnp.float8_e4m3fn)
        s = SamplingSettings(temperature=0.0, max_tokens=8)
        assert len(results) == 2
        for im, r in zip(images, results, strict=True):
            assert r.output["answer"] == ref.query(im, "What is this?", reasoning=False, settings=s).output
    finally:
        kv_scales.apply(model, saved)


def test_calibrate_kv_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the demo model it generates goes to a folder of this test's, not the user's ~/.cache/kestrel_jax
    monkeypatch.setenv("KESTREL_JAX_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    out = tmp_path / "kv.json"
    rc = cli.main(["calibrate-kv", str(bad), "--family", "md2", "--dtype", "float32", "--question", "What?",
                   "--no-caption", "--max-tokens", "2", "--out", str(out), "--quiet"])
    assert rc == 2 and "none of the given images could be read" in capsys.readouterr().err and not out.exists()
    rc = cli.main(["calibrate-kv", "--family", "md2", "--dtype", "float32", "--question", "What?", "--max-tokens",
                   "2", "--out", str(out), "--quiet"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["samples"] == 2 and summary["layers"] == tiny_config("md2").text.n_layers  # question + caption
    scales = kv_scales.load(out, summary["layers"])
    assert summary["k_scale"] == [float(scales[:, 0].min()), float(scales[:, 0].max())]
    assert summary["v_scale"] == [float(scales[:, 1].min()), float(scales[:, 1].max())]
    assert np.all(scales > 0) and not np.all(scales == 1.0)  # measured, not the 1.0 of no value
    rc = cli.main(["calibrate-kv", "--headroom", "0.5", "--out", str(out)])
    assert rc == 2 and "--headroom" in capsys.readouterr().err


def test_kv_scales_option_reaches_every_engine_config() -> None:
    from kestrel_jax.serving.server import engine_config

    parse = cli.build_parser().parse_args
    args = parse(["serve", "--kv-scales", "/s/kv.json"])
    assert engine_config(args.model, kv_scales=args.kv_scales).runner.kv_scales == "/s/kv.json"
    assert engine_config(None).runner.kv_scales is None
    args = parse(["batch", "--model", "/m", "--kv-scales", "/s/kv.json", "--out", "o.jsonl", "a.jpg"])
    assert cli._batch_engine_config(args).runner.kv_scales == "/s/kv.json"
    for cmd in (["query", "What?"], ["caption"], ["detect", "car"], ["point", "car"], ["demo"]):
        args = parse([*cmd, "--model", "/m", "--kv-scales", "/s/kv.json"])
        assert cli._engine_config(args).runner.kv_scales == "/s/kv.json"
        assert cli._engine_config(parse([*cmd, "--model", "/m"])).runner.kv_scales is None
