"""tools/bench_attention.py on the CPU (--cpu-smoke: interpreted kernels at tiny shapes): the run
checks each kernel against its jnp reference and times it beside the reference in XLA, writes
one JSON case per (op, shape) and exits; `--variants` refuses variant names it does not
know. The script otherwise runs only on a GPU, where a broken option costs a device call."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools import bench_attention  # noqa: E402


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--cpu-smoke", "--seed", "7", *args])
    bench_attention.main()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One --cpu-smoke run with --decode-cases 1x24,3x17 (two decode cases in place of the smoke
    grid's one), whose output both tests below read: each ran the whole smoke run (its prefill and
    write cases alike) for itself."""
    out = tmp_path_factory.mktemp("smoke") / "attention.json"
    with pytest.MonkeyPatch.context() as mp:
        _main(mp, "--decode-cases", "1x24,3x17", "--out", str(out))
    return json.loads(out.read_text())


def test_cpu_smoke_run_checks_every_kernel_against_its_reference(smoke: dict) -> None:
    res = smoke
    assert res["info"]["mode"] == "cpu-smoke"
    ops = sorted({c["op"] for c in res["cases"]})
    assert ops == ["decode", "prefill", "write"], ops
    for c in res["cases"]:
        kern, ref = c["impls"]["kernel"], c["impls"]["xla_ref"]
        assert "error" not in kern and "error" not in ref, c
        assert kern["us"] > 0 and ref["us"] > 0 and kern["method"] == "host"
        if c["op"] == "write":
            assert kern["exact"] is True, c
        else:  # FP8 pool, f32 accumulation: the kernel tests' bounds are 2^-10 of the values' scale
            assert kern["nan"] == 0 and kern["max_rel_err"] < 2.0**-6, c
            lay = c["impls"]["layer"]  # the engine-like call: same kernel, same bound
            assert "error" not in lay and lay["nan"] == 0 and lay["max_rel_err"] < 2.0**-6, c


def test_unknown_prefill_variants_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match="--variants: unknown"):
        _main(monkeypatch, "--tune", "--tune-prefill-only", "--variants", "noskip;no-such-variant")


def test_layer_pools_hold_each_rotations_pages_at_the_shared_table() -> None:
    """Rotation i's pool holds, at the shared table's page ids, the pages that rotation's own table
    points at (so every layer call reads the data the per-rotation call would)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(3)
    r, b, maxp, pad = 3, 2, 3, 4
    pages = r * b * maxp + 1
    k = jnp.asarray(rng.standard_normal((pages, 1, 2, 4)), jnp.float32)
    v = k * 2
    tables = np.zeros((r, b, pad), np.int32)
    tables[:, :, :maxp] = rng.permutation(pages)[: r * b * maxp].reshape(r, b, maxp)
    kps, vps, shared = bench_attention.layer_pools(rng, k, v, tables, maxp)
    sh = np.asarray(shared)
    assert sh.shape == (b, pad) and len(set(sh[:, :maxp].ravel())) == b * maxp
    for i in range(r):
        np.testing.assert_array_equal(np.asarray(kps[i])[sh[:, :maxp]], np.asarray(k)[tables[i, :, :maxp]])
        np.testing.assert_array_equal(np.asarray(vps[i])[sh[:, :maxp]], np.asarray(v)[tables[i, :, :maxp]])


def test_tune_runs_only_the_decode_variants_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--tune --variants` keeps the defaults and the named decode variants (here 16-row tiles)."""
    out = tmp_path / "tune.json"
    _main(monkeypatch, "--tune", "--decode-cases", "2x40", "--variants", "t16", "--out", str(out))
    cases = json.loads(out.read_text())["cases"]
    assert [c["op"] for c in cases] == ["decode"]
    impls = cases[0]["impls"]
    assert sorted(impls) == ["kernel", "t16"], impls
    for res in impls.values():
        assert "error" not in res and res["nan"] == 0 and res["max_rel_err"] < 2.0**-6, impls


def test_decode_cases_pick_the_part_of_the_grid_to_run(smoke: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --tune, --decode-cases replaces the decode grid (the full B x KV grid takes more than
    one device call); the prefill and write cases still run. A malformed list is refused."""
    cases = smoke["cases"]
    assert [(c["B"], c["KV"]) for c in cases if c["op"] == "decode"] == [(1, 24), (3, 17)]
    assert {c["op"] for c in cases} == {"decode", "prefill", "write"}
    for c in cases:
        assert "error" not in c["impls"]["kernel"], c
    with pytest.raises(SystemExit, match="--decode-cases"):
        _main(monkeypatch, "--decode-cases", "1x24,3by17")
    assert bench_attention.parse_cases("32x128, 8x512") == [(32, 128), (8, 512)]
