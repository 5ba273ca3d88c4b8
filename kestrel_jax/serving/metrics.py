"""The HTTP server's Prometheus metrics (`GET /metrics`, the text exposition format).

Two kinds: what the server observes per request (counts by skill and status, end-to-end latency,
time to first token, queue time, tokens, finish reasons), recorded as requests end; and the
engine's own state and counters (`InferenceEngine.stats`: running and waiting requests, KV pages,
steps, scheduler events, prefix-cache hits, images encoded), read when the endpoint is scraped.
Each `ServerMetrics` has a registry of its own, so several servers in one process (the tests) do
not share series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SKILLS = ("query", "caption", "detect", "point", "segment")
# Seconds: a cached short answer takes tens of ms on a GPU, a long caption under load tens of s.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def skill_label(path: str) -> str:
    """The skill a request path names (`/v1/query` -> "query"), "other" for anything else, so
    that a client probing paths cannot grow the label set."""
    name = path.rsplit("/", 1)[-1]
    return name if path == f"/v1/{name}" and name in SKILLS else "other"


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], Mapping[str, Any] | None]):
        """engine_stats() -> the engine's `stats` dict, or None when the engine is not serving."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kestrel_requests", "Skill requests that ended, by HTTP status (for a stream that "
                                "failed after it began: the status its error maps to)", ["skill", "status"],
                                registry=r)
        self.duration = Histogram("kestrel_request_duration_seconds", "Time from a request's arrival at the server "
                                  "to its last byte", ["skill"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kestrel_time_to_first_token_seconds", "Engine time to a request's first generated "
                              "token", ["skill"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kestrel_queue_time_seconds", "Time a request waited in the engine before its "
                               "admission", ["skill"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("kestrel_tokens", "Tokens of finished requests: input (prompt positions, image "
                              "prefix included), cached (input served from the prefix cache), output",
                              ["skill", "kind"], registry=r)
        self.finished = Counter("kestrel_finished_requests", "Requests that produced a result, by finish reason",
                                ["skill", "reason"], registry=r)
        self.in_flight = Gauge("kestrel_http_in_flight_requests", "Skill requests the server is handling now",
                               registry=r)
        r.register(_EngineCollector(engine_stats))

    def request_ended(self, skill: str, status: int, seconds: float) -> None:
        self.requests.labels(skill, str(status)).inc()
        self.duration.labels(skill).observe(max(seconds, 0.0))

    def result(self, skill: str, finish_reason: str, metrics: Any) -> None:
        """A finished request's `Result.finish_reason` and `Result.metrics` (engine.Metrics)."""
        self.finished.labels(skill, finish_reason).inc()
        for kind in ("input", "cached", "output"):
            self.tokens.labels(skill, kind).inc(max(int(getattr(metrics, f"{kind}_tokens")), 0))
        if metrics.output_tokens > 0:
            self.ttft.labels(skill).observe(max(metrics.ttft_ms, 0.0) / 1e3)
        self.queue.labels(skill).observe(max(metrics.queue_time_ms, 0.0) / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's `stats`, turned into series at each scrape."""

    def __init__(self, engine_stats: Callable[[], Mapping[str, Any] | None]):
        self._stats = engine_stats

    def describe(self) -> list[Metric]:
        return []  # the series depend on what the engine reports: described by collect()

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        up = GaugeMetricFamily("kestrel_engine_up", "1 while the engine serves, 0 once it stopped or failed")
        up.add_metric([], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        sched = _fields(stats.get("scheduler"))
        queue = stats.get("queue") or {}
        g = GaugeMetricFamily("kestrel_engine_requests", "Requests in the engine by state", labels=["state"])
        for state in ("running", "waiting"):
            if state in queue:
                g.add_metric([state], float(queue[state]))
        yield g
        if "held" in stats:
            yield GaugeMetricFamily("kestrel_engine_requests_held", "Requests the engine holds: being prepared, "
                                    "queued or running", value=float(stats["held"]))
        if stats.get("max_requests") is not None:
            yield GaugeMetricFamily("kestrel_engine_requests_limit", "Requests the engine holds before it refuses new "
                                    "ones (503 overloaded)", value=float(stats["max_requests"]))
        pages = stats.get("kv_pages") or {}
        g = GaugeMetricFamily("kestrel_kv_pages", "KV-cache pages by state (used includes the prefix cache's)",
                              labels=["state"])
        for state in ("used", "free"):
            if state in pages:
                g.add_metric([state], float(pages[state]))
        yield g
        if "num_pages" in stats:
            yield GaugeMetricFamily("kestrel_kv_pages_capacity", "KV-cache pages in the pool",
                                    value=float(stats["num_pages"]))
        c = CounterMetricFamily("kestrel_scheduler_requests", "Scheduler request events", labels=["event"])
        for event in ("admitted", "finished", "cancelled", "expired", "rejected"):
            if event in sched:
                c.add_metric([event], float(sched[event]))
        yield c
        c = CounterMetricFamily("kestrel_engine_steps", "Device steps launched (mixed: prefill steps that also "
                                "carried decode rows, counted in prefill too)", labels=["kind"])
        for kind in ("prefill", "decode", "mixed"):
            if f"{kind}_steps" in sched:
                c.add_metric([kind], float(sched[f"{kind}_steps"]))
        yield c
        c = CounterMetricFamily("kestrel_engine_rows", "Step rows computed, real and bucket padding",
                                labels=["phase", "kind"])
        for phase, real, pad in (("prefill", "prefill_tokens", "prefill_padding"),
                                 ("decode", "decode_rows", "decode_padding")):
            if real in sched and pad in sched:
                c.add_metric([phase, "real"], float(sched[real]))
                c.add_metric([phase, "padding"], float(sched[pad]))
        yield c
        cache = _fields(stats.get("prefix_cache"))
        for key, doc in (("lookups", "Prefix-cache lookups"), ("hits", "Prefix-cache hits used"),
                         ("hit_tokens", "Prompt positions served from the prefix cache"),
                         ("evicted_pages", "Pages evicted from the prefix cache")):
            if key in cache:
                yield CounterMetricFamily(f"kestrel_prefix_cache_{key}", doc, value=float(cache[key]))
        images = stats.get("images")
        if isinstance(images, Mapping):
            c = CounterMetricFamily("kestrel_images_encoded", "Images through the vision encoder, by where their "
                                    "crops were made", labels=["crops"])
            for where, n in sorted(images.items()):
                c.add_metric([str(where).removesuffix("_crops")], float(n))
            yield c


def _fields(x: Any) -> dict[str, Any]:
    """A stats entry (a dataclass or a dict) as a dict of its numeric fields."""
    if x is None:
        return {}
    items = dict(x if isinstance(x, Mapping) else vars(x))  # one copy: the engine thread updates them
    return {k: v for k, v in items.items() if isinstance(v, int | float) and not isinstance(v, bool)}
