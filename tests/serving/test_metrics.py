"""ServerMetrics without a server: the label set stays bounded, results feed the token counters and
histograms, and the engine's stats become series at each scrape (none but `up` when it stopped)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kestrel_jax.serving.engine import Metrics
from kestrel_jax.serving.metrics import ServerMetrics, skill_label
from kestrel_jax.serving.prefix_cache import PrefixCacheStats
from kestrel_jax.serving.scheduler_config import SchedulerStats


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def test_skill_labels_are_bounded() -> None:
    assert [skill_label(p) for p in ("/v1/query", "/v1/caption", "/v1/detect", "/v1/point")] == [
        "query", "caption", "detect", "point"]
    for path in ("/v1/queryx", "/v1/query/extra", "/v2/query", "/query", "/v1/", "/metrics", "/v1/x" * 50):
        assert skill_label(path) == "other", path


def test_results_feed_tokens_and_histograms() -> None:
    m = ServerMetrics(lambda: None)
    m.result("query", "stop", Metrics(ttft_ms=40.0, queue_time_ms=5.0, input_tokens=745, output_tokens=12,
                                      cached_tokens=730))
    m.result("query", "length", Metrics(ttft_ms=0.0, queue_time_ms=2.0, input_tokens=745, output_tokens=0))
    m.request_ended("query", 200, 0.3)
    m.request_ended("query", 200, 0.2)
    s = _samples(m)
    assert s[("kestrel_tokens_total", (("kind", "output"), ("skill", "query")))] == 12
    assert s[("kestrel_tokens_total", (("kind", "input"), ("skill", "query")))] == 1490
    assert s[("kestrel_tokens_total", (("kind", "cached"), ("skill", "query")))] == 730
    assert s[("kestrel_finished_requests_total", (("reason", "stop"), ("skill", "query")))] == 1
    assert s[("kestrel_finished_requests_total", (("reason", "length"), ("skill", "query")))] == 1
    # no first token, no TTFT sample; the queue time of both
    assert s[("kestrel_time_to_first_token_seconds_count", (("skill", "query"),))] == 1
    assert abs(s[("kestrel_time_to_first_token_seconds_sum", (("skill", "query"),))] - 0.04) < 1e-9
    assert s[("kestrel_queue_time_seconds_count", (("skill", "query"),))] == 2
    assert s[("kestrel_requests_total", (("skill", "query"), ("status", "200")))] == 2
    assert abs(s[("kestrel_request_duration_seconds_sum", (("skill", "query"),))] - 0.5) < 1e-9
    assert s[("kestrel_request_duration_seconds_bucket", (("le", "0.25"), ("skill", "query")))] == 1
    # the engine is not serving: up is 0 and no engine series
    assert s[("kestrel_engine_up", ())] == 0
    assert not any(name.startswith(("kestrel_kv", "kestrel_engine_steps", "kestrel_scheduler")) for name, _ in s)


def test_engine_stats_become_series() -> None:
    sched = SchedulerStats(prefill_steps=7, decode_steps=40, mixed_steps=3, prefill_tokens=5000, prefill_padding=120,
                           decode_rows=300, decode_padding=20, admitted=9, finished=6, cancelled=1, rejected=2)
    stats: dict[str, Any] = {"num_pages": 64, "queue": {"running": 2, "waiting": 1}, "held": 3, "max_requests": 1028,
                             "kv_pages": {"used": 40, "free": 24}, "scheduler": sched,
                             "prefix_cache": PrefixCacheStats(lookups=9, hits=4, hit_tokens=2920, evicted_pages=3),
                             "images": {"device_crops": 5, "host_crops": 1}}
    m = ServerMetrics(lambda: stats)
    s = _samples(m)
    assert s[("kestrel_engine_up", ())] == 1
    assert s[("kestrel_engine_requests", (("state", "running"),))] == 2
    assert s[("kestrel_engine_requests", (("state", "waiting"),))] == 1
    assert s[("kestrel_engine_requests_held", ())] == 3 and s[("kestrel_engine_requests_limit", ())] == 1028
    assert s[("kestrel_kv_pages", (("state", "used"),))] == 40 and s[("kestrel_kv_pages_capacity", ())] == 64
    assert s[("kestrel_engine_steps_total", (("kind", "decode"),))] == 40
    assert s[("kestrel_engine_steps_total", (("kind", "mixed"),))] == 3
    assert s[("kestrel_engine_rows_total", (("kind", "padding"), ("phase", "prefill")))] == 120
    assert s[("kestrel_scheduler_requests_total", (("event", "rejected"),))] == 2
    assert s[("kestrel_prefix_cache_hit_tokens_total", ())] == 2920
    assert s[("kestrel_images_encoded_total", (("crops", "device"),))] == 5
    sched.decode_steps += 1  # read again at the next scrape
    stats["queue"]["running"] = 0
    s = _samples(m)
    assert s[("kestrel_engine_steps_total", (("kind", "decode"),))] == 41
    assert s[("kestrel_engine_requests", (("state", "running"),))] == 0
