"""A worker's recent answers, for its heartbeat: requests/s and end-to-end p50/p99 of one model on this box.

The one idea: each answer is kept as (when, latency from its gateway's send), the last 4,096 of them, and the summary
reads only those of the last `window_s`: both kinds of worker count answers alike (`worker_replies.py`,
`generation_decode.py`).
"""

from __future__ import annotations

import time
from collections import deque

from appliance.envelope import RequestMeta


class RecentAnswers:
    """When a worker's recent answers came and how long each took from its gateway's send: the heartbeat's
    requests/s and end-to-end p50/p99 of a model, which `fleetbox models list` and the TUI show."""

    def __init__(self) -> None:
        self._answered: deque[tuple[float, float]] = deque(maxlen=4096)  # (when, latency ms)

    def add(self, meta: RequestMeta) -> None:
        self._answered.append((time.monotonic(), max(0.0, time.time() * 1000 - meta.sent_ms)))

    def summary(self, window_s: float) -> dict[str, float]:
        """Requests/s and p50/p99 (ms) over the last `window_s`; zeros when none came."""
        now = time.monotonic()
        recent = sorted(latency for when, latency in self._answered if now - when <= window_s)
        if not recent:
            return {"rps": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
        return {
            "rps": round(len(recent) / window_s, 2),
            "p50_ms": round(recent[len(recent) // 2], 2),
            "p99_ms": round(recent[min(len(recent) - 1, int(len(recent) * 0.99))], 2),
        }
