"""The gateway's wait estimate (Little's law over one model's queue, weighed by cost), without a box."""

from __future__ import annotations

import pytest

from appliance.gateway.admission import ModelQueue


def busy(q: ModelQueue, start: float, seconds: float, per_s: int, weight: int = 1) -> float:
    """Keep `q` busy from `start` for `seconds`, answering `per_s` requests of `weight` a second; returns the end.

    A request of no weight, "head", waits throughout (and after, until the caller removes it).
    """
    step = 1 / per_s
    q.add("head", start, 0)
    for i in range(round(seconds * per_s)):
        q.add(f"{start}:{i}", start + i * step, weight)
        q.remove(f"{start}:{i}", start + (i + 1) * step, answered=True)
    return start + seconds


def test_wait_is_the_work_awaited_over_the_rate_it_is_answered() -> None:
    q = ModelQueue()
    now = busy(q, 10.0, 2.0, per_s=100, weight=10)  # 1,000 tokens a second
    for i in range(30):
        q.add(f"r{i}", now, 100)
    assert q.wait_s(now) == pytest.approx(3000 / 1000)  # "head" has waited since 10.0: the estimate is trusted


def test_a_large_request_weighs_its_tokens_not_one() -> None:
    q = ModelQueue()
    now = busy(q, 10.0, 2.0, per_s=100, weight=10)
    q.add("bulk", now, 250 * 128)  # 250 inputs of 128 tokens
    q.add("word", now, 3)
    assert q.wait_s(now + 0.5) > 30  # counted by requests it would be 2 / 100 per second: 0.02 s


def test_idle_time_does_not_dilute_the_rate() -> None:
    q = ModelQueue()
    end = busy(q, 10.0, 1.0, per_s=100)
    q.remove("head", end, answered=False)
    now = end + 1.2  # idle for 1.2 s: the window still holds the last busy spans
    q.add("r", now, 50)
    assert q.rate(now) == 100


def test_answers_seconds_apart_still_give_a_rate() -> None:
    """A big request answered every 5 s: no fixed 2 s window of answers would hold one."""
    q = ModelQueue()
    for i in range(5):
        q.add(f"big{i}", 0.0, 1000)
    for i in range(2):
        q.remove(f"big{i}", 5.0 * (i + 1), answered=True)
    assert q.wait_s(11.0) == 3000 / (1000 / 6.0)  # the last span (5 s), and the one open since (1 s)
    assert q.wait_s(10.0) == 3000 / 200


def test_a_stall_dilutes_the_rate_until_answers_come_again() -> None:
    q = ModelQueue()
    now = busy(q, 0.0, 1.0, per_s=100)
    q.add("stuck", now - 0.5, 10)
    early, late = q.wait_s(now + 1.0), q.wait_s(now + 9.0)
    assert early is not None and late is not None and late > early


def test_no_estimate_before_the_oldest_request_waited_or_anything_was_answered() -> None:
    q = ModelQueue()
    now = busy(q, 0.0, 1.0, per_s=100)
    q.remove("head", now, answered=False)
    q.add("fresh", now, 10)
    assert q.wait_s(now + 0.3) is None  # a fresh burst: nothing to refuse yet
    cold = ModelQueue()
    cold.add("first", 0.0, 10)
    assert cold.wait_s(5.0) is None  # nothing ever answered (a cold load): deadlines bound it
    q.remove("fresh", now + 0.4, answered=False)
    assert q.wait_s(now + 1.0) is None  # nothing waiting


def test_short_busy_spells_are_not_taken_for_the_models_rate() -> None:
    """One request answered alone in 5 ms says how fast one request goes, not how fast a full queue drains."""
    q = ModelQueue()
    for i in range(20):
        q.add(f"r{i}", i * 0.1, 10)
        q.remove(f"r{i}", i * 0.1 + 0.005, answered=True)
    assert not q.spans
    q.add("next", 2.0, 10)
    assert q.wait_s(3.0) is None


def test_a_model_busy_again_after_an_idle_gap_is_not_judged_by_its_old_pace_nor_its_reload() -> None:
    """Idle for an hour, then reloading for 20 s (evicted, or its box gone): the old spans are forgotten,
    so the reload is not read as a stall and nothing is refused; once answers flow again, the rate is
    timed from the first of them, not from the start of the reload."""
    q = ModelQueue()
    end = busy(q, 0.0, 2.0, per_s=100, weight=50)
    q.remove("head", end, answered=False)
    start = end + 3600.0
    for i in range(200):  # 10 requests a second arrive while the model reloads
        q.add(f"r{i}", start + i * 0.1, 50)
    assert q.wait_s(start + 19.9) is None  # nothing answered yet in this spell: deadlines bound it
    for i in range(100):  # then the model answers 100 a second
        q.remove(f"r{i}", start + 20.0 + i * 0.01, answered=True)
    assert q.wait_s(start + 21.0) == pytest.approx(100 * 50 / 5000, rel=0.05)
