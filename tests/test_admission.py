"""The gateway's wait estimate (Little's law over one model's queue), without a box."""

from __future__ import annotations

from appliance.gateway.dispatch import ModelQueue


def queue(answer_times: list[float], sent_times: list[float]) -> ModelQueue:
    q = ModelQueue()
    for t in answer_times:
        q.answer(t)
    q.waiting = {f"r{i}": t for i, t in enumerate(sent_times)}
    return q


def test_wait_is_the_requests_awaited_over_the_rate_answers_come_back() -> None:
    q = queue([10 + i * 0.01 for i in range(200)], [9.0 + i * 0.001 for i in range(300)])  # 100 answers/s
    assert q.wait_s(12.0) == 300 / 100


def test_only_the_last_two_seconds_of_answers_count() -> None:
    q = queue([i * 0.001 for i in range(5000)] + [10 + i * 0.1 for i in range(20)], [5.0] * 40)  # then 10/s
    assert q.wait_s(12.0) == 40 / 10
    assert len(q.answered) == 20  # the old burst is forgotten, not just skipped


def test_no_estimate_before_the_oldest_request_waited_or_without_answers() -> None:
    assert queue([9.9], [11.8]).wait_s(12.0) is None  # a fresh burst: nothing to refuse yet
    assert queue([], [5.0]).wait_s(12.0) is None  # nothing answered lately (a cold load): deadlines bound it
    assert queue([11.0], []).wait_s(12.0) is None  # nothing waiting


def test_a_young_queue_is_judged_over_its_own_age() -> None:
    """Right after an idle spell, only the answers since the oldest request was sent say what the box does."""
    q = queue([5.0] + [11.0 + i * 0.01 for i in range(50)], [11.0] * 100)  # 50 answers in the last second
    assert q.wait_s(12.0) == 100 * 1.0 / 50
