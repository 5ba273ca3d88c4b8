"""The command line end to end, on the synthetic demo model (subprocesses, as a user runs it).

Commands whose tests only read their exit codes and outputs share a subprocess (`_run_many`: each
one a fresh `main(argv)` with the process's file descriptors 1 and 2 captured, as a shell would
give them): every command costs a Python and JAX start-up of its own otherwise (~3 s on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _run(args: list[str], cache: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KESTREL_JAX_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "kestrel_jax", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# Runs each command line of argv[1] (JSON) as `python -m kestrel_jax` would, one after the other in
# this process: `main(argv)`'s return value or SystemExit code, an uncaught exception's traceback on
# the captured standard error and exit code 1; prints the (code, stdout, stderr) list as JSON.
_MANY = r"""
import json, os, sys, tempfile, traceback
from kestrel_jax.cli import main

def run(argv):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                rc = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        return rc, out.read().decode(), err.read().decode()

results = [run(argv) for argv in json.loads(sys.argv[1])]
sys.stdout.write("\nKESTREL_MANY " + json.dumps(results) + "\n")
"""


def _run_many(commands: list[list[str]], cache: Path, timeout: int = 900) -> list[subprocess.CompletedProcess[str]]:
    """The command lines in one subprocess, in order (`_MANY`); one CompletedProcess each."""
    env = dict(os.environ, KESTREL_JAX_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-c", _MANY, json.dumps(commands)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0 and "KESTREL_MANY " in p.stdout, (p.stdout[-3000:], p.stderr[-3000:])
    results = json.loads(p.stdout.rsplit("KESTREL_MANY ", 1)[1])
    assert len(results) == len(commands)
    return [subprocess.CompletedProcess(["kestrel_jax", *argv], rc, out, err)
            for argv, (rc, out, err) in zip(commands, results, strict=True)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_demo_runs_every_skill_and_says_weights_are_random(cache: Path) -> None:
    p = _run(["demo", "--max-tokens", "3", "--max-objects", "1"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    for skill in ("caption", "query", "query (reasoning)", "detect", "point", "segment"):
        assert f"[demo] {skill}" in p.stdout, p.stdout
    assert "RANDOM weights" in p.stderr and "noise" in p.stdout
    assert (cache / "demo-tiny-md3-v3" / ".complete").exists()
    # the compiled steps are kept for the next command (the tests below load them)
    compiled = [f for f in (cache / "compile").rglob("*") if f.is_file()]
    assert compiled and any(f.suffix == ".jaxexport" for f in compiled)


@pytest.fixture(scope="module")
def one_shot(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The commands of the three tests below, in one subprocess (after the demo test's command,
    which writes the checkpoint and the compiled steps they load): name -> CompletedProcess, and
    the paths they were given."""
    tmp = tmp_path_factory.mktemp("one_shot")
    bad = tmp / "not_an_image.png"
    bad.write_bytes(b"this is not an image")
    mask = tmp / "mask.png"
    commands = {
        "detect": ["detect", "car", "--json", "--quiet", "--max-objects", "2"],
        "segment": ["segment", "sun", "--json", "--quiet", "--max-tokens", "6", "--mask", str(mask)],
        "segment_md2": ["segment", "sun", "--family", "md2", "--quiet"],
        "bad_image": ["caption", "--image", str(bad), "--quiet"],
        "bad_temperature": ["query", "--quiet", "--temperature", "-1", "hi"],
        "missing_model": ["caption", "--model", str(tmp / "missing")],
    }
    done = _run_many(list(commands.values()), cache)
    return {"mask": mask, **dict(zip(commands, done, strict=True))}


def test_detect_json_output(one_shot: dict[str, Any]) -> None:
    p = one_shot["detect"]
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert isinstance(out["objects"], list) and len(out["objects"]) <= 2
    for box in out["objects"]:
        assert set(box) == {"x_min", "y_min", "x_max", "y_max"}


def test_segment_json_output_and_mask(one_shot: dict[str, Any]) -> None:
    from PIL import Image

    from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH

    mask = one_shot["mask"]
    p = one_shot["segment"]
    assert p.returncode == 0, p.stderr[-3000:]
    (seg,) = json.loads(p.stdout.strip().splitlines()[-1])["segments"]
    assert seg["object"] == "sun" and isinstance(seg["svg_path"], str) and len(seg["token_ids"]) <= 6
    with Image.open(mask) as m, Image.open(DEMO_IMAGE_PATH) as img:
        assert m.size == img.size and m.mode == "L"
    p = one_shot["segment_md2"]
    assert p.returncode == 2 and "no segment skill" in p.stderr and "Traceback" not in p.stderr


def test_bad_input_gives_a_clear_error_not_a_traceback(one_shot: dict[str, Any]) -> None:
    p = one_shot["bad_image"]
    assert p.returncode == 2
    assert "kestrel-jax: error:" in p.stderr and "Traceback" not in p.stderr
    p = one_shot["bad_temperature"]
    assert p.returncode == 2 and "temperature" in p.stderr
    p = one_shot["missing_model"]
    assert p.returncode == 2 and "no such checkpoint" in p.stderr


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_over_folders_fails_bad_images_alone_and_resumes(cache: Path, tmp_path: Path) -> None:
    """`batch`: a folder (recursively, images only) and a missing file; a JSON line per request;
    the corrupt and missing images fail alone (exit 1); --resume runs only what has no result,
    here after the two inputs were fixed (exit 0); an existing --out without --resume is refused."""
    from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH

    imgs = tmp_path / "imgs"
    (imgs / "sub").mkdir(parents=True)
    (imgs / "a.png").write_bytes(DEMO_IMAGE_PATH.read_bytes())
    (imgs / "sub" / "b.PNG").write_bytes(DEMO_IMAGE_PATH.read_bytes())
    (imgs / "c.jpg").write_bytes(b"not an image")
    (imgs / "notes.txt").write_text("not an input")
    out = tmp_path / "captions.jsonl"
    args = ["batch", "--skill", "caption", "--length", "short", "--max-tokens", "3", "--max-batch-size", "4",
            str(imgs), str(tmp_path / "later.png"), "--out", str(out)]
    p, p_again = _run_many([args, args], cache)  # one process: the second finds the first's --out
    assert p.returncode == 1, p.stderr[-3000:]
    assert "2 ok, 2 failed" in p.stderr and "Traceback" not in p.stderr
    lines = _lines(out)
    assert sorted(Path(r["image"]).name for r in lines) == ["a.png", "b.PNG", "c.jpg", "later.png"]
    for r in lines:
        assert r["skill"] == "caption" and r["length"] == "short" and r["settings"] == {"max_tokens": 3}
        if Path(r["image"]).name in ("c.jpg", "later.png"):
            assert r["error"]["type"] == "invalid_image" and "output" not in r
        else:
            assert isinstance(r["output"]["caption"], str) and r["metrics"]["output_tokens"] == 3
            assert r["finish_reason"] == "length"
    # refused before writing: `lines` (read after both) holds the first run's four results only
    assert p_again.returncode == 2 and "--resume" in p_again.stderr
    (imgs / "c.jpg").write_bytes(DEMO_IMAGE_PATH.read_bytes())
    (tmp_path / "later.png").write_bytes(DEMO_IMAGE_PATH.read_bytes())
    with open(out, "a") as f:
        f.write('{"skill": "caption", "image": "torn')  # a run killed mid-line
    p = _run([*args, "--resume", "--quiet"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 ok, 0 failed, 2 already done" in p.stderr
    text = out.read_text().splitlines()
    assert text[len(lines)].endswith('"torn')
    new = [json.loads(line) for line in text[len(lines) + 1:]]
    assert sorted(Path(r["image"]).name for r in new) == ["c.jpg", "later.png"]
    assert all("output" in r for r in new)


def test_batch_requests_file_mixes_skills(cache: Path, tmp_path: Path) -> None:
    """`batch --requests`: a JSONL of requests of several skills, an unknown skill failing alone;
    a malformed line stops the job with its line number (exit 2), what ended before it kept."""
    from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH

    img = str(DEMO_IMAGE_PATH)
    reqs = [{"skill": "query", "image": img, "question": "What is this?", "reasoning": False,
             "settings": {"max_tokens": 2, "temperature": 0}},
            {"skill": "point", "image": img, "object": "sun", "settings": {"max_objects": 1}},
            {"skill": "query", "image": None, "question": "Hello", "settings": {"max_tokens": 2}},
            {"skill": "sing", "image": img},
            {"skill": "segment", "image": img, "object": "sun", "spatial_refs": [[0.5, 0.5]],
             "settings": {"max_tokens": 2}}]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps(r) for r in reqs) + "\n\n")
    out = tmp_path / "out.jsonl"
    malformed = tmp_path / "malformed" / "jobs.jsonl"
    malformed.parent.mkdir()
    malformed.write_text(json.dumps(reqs[2]) + "\n{not json\n")
    # one subprocess; none of the later three writes `out`
    p, p_malformed, p_no_object, p_missing = _run_many([
        ["batch", "--requests", str(jobs), "--out", str(out), "--max-batch-size", "4", "--quiet"],
        ["batch", "--requests", str(malformed), "--out", str(tmp_path / "o2.jsonl"), "--max-batch-size", "4",
         "--quiet"],
        ["batch", "--skill", "detect", str(jobs), "--out", str(tmp_path / "o3.jsonl")],
        ["batch", "--requests", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o4.jsonl")]], cache)
    assert p.returncode == 1, p.stderr[-3000:]
    got = {json.dumps({k: r[k] for k in r if k not in ("output", "finish_reason", "metrics", "error")},
                      sort_keys=True): r for r in _lines(out)}
    assert set(got) == {json.dumps(r, sort_keys=True) for r in reqs}
    assert got[json.dumps(reqs[3], sort_keys=True)]["error"]["type"] == "invalid_request"
    assert isinstance(got[json.dumps(reqs[0], sort_keys=True)]["output"]["answer"], str)
    assert isinstance(got[json.dumps(reqs[1], sort_keys=True)]["output"]["points"], list)
    (seg,) = got[json.dumps(reqs[4], sort_keys=True)]["output"]["segments"]
    assert seg["object"] == "sun" and len(seg["token_ids"]) <= 2
    p = p_malformed
    assert p.returncode == 2 and "jobs.jsonl:2" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p_no_object.returncode == 2 and "--object" in p_no_object.stderr
    p = p_missing
    assert p.returncode == 2 and "no such file" in p.stderr and "ready" not in p.stderr  # before any model load
