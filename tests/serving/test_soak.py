"""A few seconds of tools/soak_engine.py on the shared tiny engine: every skill, streamed and not,
bad inputs, cancellations and deadlines from concurrent clients; every request ends as its input
calls for, and afterwards the engine holds nothing and answers as it did before."""

from __future__ import annotations

from kestrel_jax.serving.engine import InferenceEngine


def test_soak_leaves_nothing_behind(engine: InferenceEngine) -> None:
    from tools.soak_engine import KINDS, soak

    report = soak(engine, seconds=12.0, clients=8, seed=7, request_timeout_s=90.0)
    assert report["failures"] == [], report
    kinds = {key.split(":")[0] for key in report["outcomes"]}
    assert report["requests"] >= 20 and len(kinds) >= len(KINDS) - 2, report
    assert any(key.endswith(":result") for key in report["outcomes"]), report
