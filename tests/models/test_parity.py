"""Golden parity for Moondream 2 and Moondream 3 through the normal loader (float32)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import pytest

from kestrel_jax.parity import run_parity

REPO = Path(__file__).resolve().parents[2]


def test_golden_parity_all_models(golden_dir: Path) -> None:
    reports = run_parity(golden_dir)
    names = sorted(r.model for r in reports)
    assert names == ["md2", "md3"], names
    failures = [line for r in reports for line in r.lines() if "FAIL" in line]
    assert not failures, "\n".join(failures)
    # Every stage the golden README lists for a model was compared.
    md3 = next(r for r in reports if r.model == "md3")
    checked = {x.name for x in md3.results}
    for key in ("vision_features", "prefix_k_cache_layer0", "prompt_tau_q", "prompt_topk_idx_layer2",
                "decode_logits", "reasoning_api_logits", "region_size_logits", "detect_objects"):
        assert key in checked, key


def test_parity_tool_fails_on_a_corrupted_golden(tmp_path: Path, golden_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The tool must exit non-zero when a golden tensor disagrees (here: a perturbed K cache).
    Its main() runs in this process, so the MD2 stages the test above compiled are reused (in a
    subprocess the tool compiles them all again: ~35 s on a CPU)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    root = tmp_path / "golden"
    (root / "md2").mkdir(parents=True)
    for name in ("image.png", "crops.safetensors"):
        (root / name).symlink_to(golden_dir / name)
    for name in ("config.json", "model.safetensors", "golden.json"):
        (root / "md2" / name).symlink_to(golden_dir / "md2" / name)
    gold = load_file(str(golden_dir / "md2" / "golden.safetensors"))
    k = gold["prefix_k_cache_layer0"]
    k[0, 5, 3] += 1e-3 * np.abs(k).max()
    save_file(gold, str(root / "md2" / "golden.safetensors"))
    spec = importlib.util.spec_from_file_location("kjx_parity_tool", REPO / "tools" / "parity.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    precision = jax.config.jax_default_matmul_precision
    try:
        rc = tool.main([str(root)])
    finally:  # main() sets it for the whole process
        jax.config.update("jax_default_matmul_precision", precision)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "FAIL prefix_k_cache_layer0" in out, out
    assert "parity FAILED for 1 model(s)" in out, out
