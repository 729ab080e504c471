"""Prometheus metrics of one box, in a registry the box owns (no module-level globals)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_MS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fbx_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.request_ms = Histogram(
            "fbx_http_request_ms", "HTTP request latency (ms)", ["route"], buckets=_MS_BUCKETS, registry=r
        )
        self.queue_ms = Histogram(
            "fbx_queue_ms", "Time from publish to batch start (ms)", ["model"], buckets=_MS_BUCKETS, registry=r
        )
        self.compute_ms = Histogram(
            "fbx_compute_ms", "Forward pass time per batch (ms)", ["model"], buckets=_MS_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "fbx_batch_size",
            "Rows per batch",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.batch_tokens = Histogram(
            "fbx_batch_tokens",
            "Padded tokens per batch",
            ["model"],
            buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
            registry=r,
        )
        self.rows_computed = Counter("fbx_rows_computed", "Inputs run through a model", ["model"], registry=r)
        self.expired = Counter(
            "fbx_expired_requests", "Requests dropped because their deadline passed", ["model"], registry=r
        )
        self.duplicate_replies = Counter(
            "fbx_ignored_replies",
            "Replies dropped because their request was already answered (a redelivery) or abandoned",
            registry=r,
        )
        self.redelivered = Counter(
            "fbx_redelivered_requests", "Requests received again after another box held them", ["model"], registry=r
        )
        self.cancelled = Counter(
            "fbx_cancelled_requests",
            "Requests dropped because their client went away: before compute, or a generation at its next step",
            ["model"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "fbx_dead_lettered_requests",
            "Requests this box moved to FBX_DLQ after failing every delivery (or every box holding them died)",
            ["model"],
            registry=r,
        )
        self.refused = Counter(
            "fbx_refused_requests",
            "Requests refused at admission: 429, they would wait past max_queue_s to start (503: no live box holds it)",
            ["model"],
            registry=r,
        )
        self.backlog = Gauge(
            "fbx_stream_backlog",
            "Messages in the request stream FBX_REQ: waiting, plus held by a worker and not yet acked",
            registry=r,
        )
        self.resident_bytes = Gauge(
            "fbx_resident_model_bytes", "Measured bytes of each resident model", ["model"], registry=r
        )
        self.evictions = Counter("fbx_model_evictions", "Model evictions by reason", ["model", "reason"], registry=r)
        self.cold_start_ms = Histogram(
            "fbx_cold_start_wait_ms",
            "Time a request for a cold model waited for its load (ms)",
            ["model"],
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.first_token_ms = Histogram(
            "fbx_time_to_first_token_ms",
            "A generation's time from its arrival at the gateway to its first chunk (ms)",
            ["model"],
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.token_ms = Histogram(
            "fbx_time_per_output_token_ms",
            "A generation's time per token after its first, as its chunks came (ms)",
            ["model"],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.generations = Gauge(
            "fbx_generations",
            "Generations this box holds: running (a token made) or waiting (for a decode slot, or being admitted)",
            ["model", "state"],
            registry=r,
        )
        self.stream_errors = Counter(
            "fbx_stream_errors",
            "Streamed answers this gateway ended with an error event after their first chunk (their status was 200)",
            ["model", "code"],
            registry=r,
        )
        self.loads = Counter("fbx_model_loads", "Model loads", ["model"], registry=r)
        self.load_seconds = Histogram(
            "fbx_model_load_seconds",
            "Model load time (s)",
            ["model"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )

    def dropped(self, model: str, why: str) -> None:
        """A request a box dropped on a cancel (`delivery.CancelWhy`): its client gone (or its gateway's box, with
        its clients), its deadline passed, or one its gateway answered without the queue, which neither counts."""
        if why in ("gone", "gateway_gone"):
            self.cancelled.labels(model).inc()
        elif why == "expired":
            self.expired.labels(model).inc()

    def forget(self, model: str) -> None:
        """Drop every series of a deleted model or adapter: a fleet that registers and deletes adapters all day grew
        /metrics by four series each, for good (tester h70)."""
        for metric in vars(self).values():
            names: tuple[str, ...] = getattr(metric, "_labelnames", ())  # prometheus_client keeps them unexposed
            if "model" not in names:
                continue
            at = names.index("model")
            for family in metric.collect():
                for labels in {tuple(sample.labels.get(name, "") for name in names) for sample in family.samples}:
                    if labels[at] == model:
                        with contextlib.suppress(KeyError):
                            metric.remove(*labels)
