"""A few seconds of tools/soak_engine.py on the shared tiny engine, direct and over HTTP: every
skill, streamed and not, bad inputs, cancellations and deadlines from concurrent clients; every
request ends as its input calls for, and afterwards the engine holds nothing and answers as it
did before."""

from __future__ import annotations

from kestrel_jax.serving.engine import InferenceEngine


def test_soak_leaves_nothing_behind(engine: InferenceEngine) -> None:
    from tools.soak_engine import KINDS, soak

    # at least 20 requests, however slow the machine: the floors below are a mix, not a speed
    report = soak(engine, seconds=12.0, clients=8, seed=7, request_timeout_s=90.0, min_requests=20)
    assert report["failures"] == [], report
    kinds = {key.split(":")[0] for key in report["outcomes"]}
    assert report["requests"] >= 20 and len(kinds) >= len(KINDS) - 2, report
    assert any(key.endswith(":result") for key in report["outcomes"]), report


def test_soak_over_http_leaves_nothing_in_flight(engine: InferenceEngine) -> None:
    """The same through the HTTP server: malformed bodies, bad images, unknown fields and paths get
    their 4xx, clients that hang up mid-stream or before a reply leave nothing behind, no 5xx."""
    from tools.soak_engine import soak

    report = soak(engine, seconds=8.0, clients=6, seed=11, request_timeout_s=90.0, http=True, min_requests=15)
    assert report["failures"] == [], report
    assert report["requests"] >= 15 and any(k.startswith("hang_up") for k in report["outcomes"]), report


def test_soak_runs_on_to_its_request_floor(engine: InferenceEngine) -> None:
    """Past its `seconds`, the soak goes on until `min_requests` requests have ended (each client
    starts none once the floor is met), and never past `max_seconds`."""
    from tools.soak_engine import soak

    report = soak(engine, seconds=0.0, clients=2, seed=3, request_timeout_s=90.0, min_requests=4, max_seconds=120.0)
    assert report["failures"] == [] and 4 <= report["requests"] <= 5, report
    report = soak(engine, seconds=0.0, clients=2, seed=3, request_timeout_s=90.0, min_requests=4, max_seconds=0.0)
    assert report["failures"] == [] and report["requests"] == 0, report
