"""Loading synthetic checkpoints into the model; conversion to the orbax format and back."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.loader import convert_checkpoint, load_model
from kestrel_jax.models.text import MoE
from kestrel_jax.pallas.moe import dequantize_experts


def _flat(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def md3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("md3"), tiny_config("md3"), seed=11,
                                      kv_scales=True, shards=2)


def test_hf_checkpoint_loads_with_transposes_and_kv_scales(md3_dir: Path) -> None:
    from kestrel_jax.checkpoint.reader import HFCheckpoint

    ckpt = HFCheckpoint.open(md3_dir, progress=False)
    model = load_model(md3_dir, dtype=jnp.float32, progress=False)
    qkv = ckpt.read("text.blocks.1.attn.qkv.weight").astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.text.blocks[1].attn.qkv.kernel[...]), qkv.T)
    up = ckpt.read("text.blocks.3.mlp.fc1.weight").astype(np.float32)
    moe = model.text.blocks[3].mlp
    assert isinstance(moe, MoE)
    np.testing.assert_array_equal(np.asarray(moe.fc1[...]), up)  # [E, 2I, D] as stored
    ks = float(ckpt.read("text.blocks.2.attn.k_scale"))
    assert float(model.text.kv_scales[...][2, 0]) == ks


def test_fp8_experts_quantised_on_load(md3_dir: Path) -> None:
    ref = load_model(md3_dir, dtype=jnp.float32, progress=False)
    q = load_model(md3_dir, dtype=jnp.float32, fp8_experts=True, progress=False)
    w, r = q.text.blocks[2].mlp, ref.text.blocks[2].mlp
    assert isinstance(w, MoE) and isinstance(r, MoE)
    assert w.fc1[...].dtype == jnp.float8_e4m3fn and w.fc1_scale is not None
    deq = np.asarray(dequantize_experts(w.fc1[...], w.fc1_scale[...]))
    exact = np.asarray(r.fc1[...])
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 of the row's scale range.
    rel = np.abs(deq - exact).max(axis=-1) / np.abs(exact).max(axis=-1)
    assert rel.max() < 0.07


def test_convert_and_restore_round_trip(md3_dir: Path, tmp_path: Path) -> None:
    times = convert_checkpoint(md3_dir, tmp_path / "conv", progress=False)
    assert times["load_s"] >= 0 and times["save_s"] >= 0
    a = _flat(load_model(md3_dir, progress=False))
    b = _flat(load_model(tmp_path / "conv", progress=False))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)
    with pytest.raises(CheckpointError, match="convert again"):
        load_model(tmp_path / "conv", fp8_experts=True, progress=False)
    with pytest.raises(CheckpointError, match="exists"):
        convert_checkpoint(md3_dir, tmp_path / "conv", progress=False)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="only local paths"):
        load_model(tmp_path / "nope")


def test_md2_synthetic_runs_forward(tmp_path: Path) -> None:
    from kestrel_jax.generate import ReferenceGenerator
    from kestrel_jax.pallas import ops

    d = write_synthetic_checkpoint(tmp_path / "md2", tiny_config("md2"), seed=3)
    model = load_model(d, progress=False)
    with ops.use_backend("reference"):
        gen = ReferenceGenerator(model, page_size=16, max_len=64)
        seq = gen.new_sequence()
        out = gen.feed(seq, gen.embed_ids([0, 1, 2, 3]))
    assert out.logits.shape == (8192,) and np.isfinite(out.logits).all()
    # lm_head bias suppresses ids < 16 in synthetic checkpoints (benchmarks run to max_tokens).
    assert int(np.argmax(out.logits)) >= 16
    assert jax.devices()[0].platform == "cpu"


def test_convert_tool_script(md3_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(repo / "tools" / "convert_checkpoint.py"), str(md3_dir),
                        str(tmp_path / "out"), "--fp8-experts", "on"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "converted" in p.stdout
    model = load_model(tmp_path / "out", progress=False)
    moe = model.text.blocks[3].mlp
    assert isinstance(moe, MoE)
    assert model.fp8_experts and moe.fc1[...].dtype == jnp.float8_e4m3fn
    bad = subprocess.run([sys.executable, str(repo / "tools" / "convert_checkpoint.py"), str(tmp_path / "nope"),
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "no such checkpoint" in bad.stderr
