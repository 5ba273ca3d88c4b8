"""Golden parity for Moondream 2 and Moondream 3 through the normal loader (float32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_parity_tool_fails_on_a_corrupted_golden(tmp_path: Path, golden_dir: Path) -> None:
    """The tool must exit non-zero when a golden tensor disagrees (here: a perturbed K cache)."""
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
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "parity.py"), str(root)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL prefix_k_cache_layer0" in proc.stdout, proc.stdout
