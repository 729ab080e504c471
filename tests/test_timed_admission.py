"""Admission of a burst on an idle model whose pace is known: what starts within the bound at that pace goes.

Tester h214: on an idle box whose reranker had just answered a 64-document request in 2 s, 10 such requests sent at
once had 8 refused 429 "... before it has timed the model's answers", `Retry-After: 1`. The unit test drives
`Admission` with a clock of its own against a fake model (`drive` of test_admission: the policy is under test); the
box test sends the burst through a real gateway, NATS and worker, to a no-op model whose batches sleep a set cost.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from appliance.errors import TooManyRequests
from appliance.gateway.admission import paced_round
from appliance.gateway.model_queue import ModelQueue
from tests.test_admission import Clock, admission, drive

RERANK = 64 * 512  # the gateway's estimate of 64 documents of 400 words: 512 tokens each, at most
RERANK_PER_S = RERANK / 2.0  # the 2-core box: 2 s for one such request


def test_a_burst_on_an_idle_model_this_gateway_timed_is_let_in_as_far_as_its_pace_starts_it_within_the_bound() -> None:
    """One request answered in 2 s times the model; 4 s later 10 are sent at once. Held to twice that spell's work,
    2 were let in; at its pace, those whose work ahead starts within 10 s go (6: 5 × 2 s ahead of the last), and
    the rest are told how long the wait would be, with a Retry-After to match, not 1."""
    clock = Clock()
    gate = admission(clock)
    (warm,) = drive(gate, clock, [100.0], weight=RERANK, per_s=RERANK_PER_S, budget=16_384)
    assert warm.status == 200
    clock.now += 4.0
    burst = drive(gate, clock, [clock.now] * 10, weight=RERANK, per_s=RERANK_PER_S, budget=16_384)
    assert [o.status for o in burst] == [200] * 6 + [429] * 4
    assert max(o.wait_s for o in burst if o.status == 200) <= 10.0
    assert {o.retry_after for o in burst if o.status == 429} == {2}  # 12 s of work ahead, against 10


def test_the_429_of_a_burst_says_the_wait_at_the_pace_the_model_was_timed_at() -> None:
    """The words were "as much as it lets wait before it has timed the model's answers": untrue of a model timed."""
    clock = Clock()
    gate = admission(clock)
    drive(gate, clock, [100.0], weight=RERANK, per_s=RERANK_PER_S, budget=16_384)
    clock.now += 4.0
    for i in range(6):
        gate.admit("m", "interactive", 60.0, i, weight=RERANK, budget=16_384).add(f"r{i}", clock.now, RERANK)
    try:
        gate.admit("m", "interactive", 60.0, 6, weight=RERANK, budget=16_384)
    except TooManyRequests as refused:
        message = refused.message
    else:
        raise AssertionError("the seventh was let in")
    assert "the 6 requests this gateway awaits for it would take about 12s to start" in message
    assert "at the pace this gateway timed its answers at, over 10s; retry in 2s" in message


def _burst_after(idle_s: float, paced_then: int, paced_now: int) -> int:
    """Of 10 reranks sent at once `idle_s` after one answered in 2 s, how many are let in; the holders' heartbeats
    said a pace of `paced_then` then (`paced_round`), `paced_now` at the burst."""
    clock = Clock()
    gate = admission(clock)
    queue = gate.admit("m", "interactive", 60.0, 0, weight=RERANK, budget=16_384, paced=paced_then)
    queue.add("warm", clock.now, RERANK, rows=64)
    clock.now += 2.0
    queue.remove("warm", clock.now, answered=True)
    clock.now += idle_s
    admitted = 0
    for i in range(10):
        try:
            queue = gate.admit("m", "interactive", 60.0, i, weight=RERANK, budget=16_384, paced=paced_now)
        except TooManyRequests:
            continue
        queue.add(f"r{i}", clock.now, RERANK, rows=64)
        admitted += 1
    return admitted


HEARTBEAT = paced_round(12_000.0, None, None)  # the holders say 12,000 padded tokens a second: halved, 60,000 in 10 s


@pytest.mark.parametrize(
    ("idle_s", "paced_then", "paced_now", "admitted"),
    [
        (4.0, HEARTBEAT, HEARTBEAT, 6),
        (65.0, HEARTBEAT, HEARTBEAT, 6),  # a minute on, the same holders' pace: the timing still holds (was 2)
        (4.0, HEARTBEAT, HEARTBEAT // 2, 3),  # the holders go half as fast now: so does the pace timed
        (65.0, HEARTBEAT, HEARTBEAT // 2, 3),
        (65.0, 0, 0, 2),  # no holders' pace to follow, a minute on: twice the spell's work, as before
    ],
)
def test_a_pace_this_gateway_timed_holds_for_like_work_as_far_as_the_holders_pace_now_allows(
    idle_s: float, paced_then: int, paced_now: int, admitted: int
) -> None:
    """Tester h214's burst, sent a while after the model was timed: the gateway's own timing is in its own estimate
    (here 512 tokens a document where the model takes 404), the holders' pace in padded tokens, halved for that, 2
    of the 10. Kept, the timing follows the holders' pace: a box slower now is not taken at its old pace."""
    assert _burst_after(idle_s, paced_then, paced_now) == admitted


def _timed_queue() -> ModelQueue:
    """A model timed at 16,384 weight a second (64 rows of 512 in 2 s) while its holders said a pace of 1,000."""
    queue = ModelQueue()
    queue.holders_pace = 1000.0
    queue.add("a", 0.0, 32768, rows=64)
    queue.remove("a", 2.0, answered=True)
    assert queue.timed_pace(2.0, 512) > 0
    return queue


def test_a_timed_pace_is_not_trusted_for_holders_that_did_not_time_it() -> None:
    """Review h223: the pace timed on one box outlived a change of holders for a minute: measured afresh
    (`restart_rate`, another box holds it now) or evicted and loaded afresh by a box that says no pace yet, the old
    box's pace still let in 10 s of its work for a box never timed."""
    afresh = _timed_queue()
    afresh.restart_rate(5.0)
    assert afresh.timed_pace(5.0, 512) == 0.0
    reloaded = _timed_queue()
    reloaded.away()
    reloaded.holders_pace = 0.0  # its holders say no pace now
    assert reloaded.timed_pace(30.0, 512) == 0.0
    reloaded.holders_pace = 1000.0  # the same pace as when it was timed: trusted again
    assert reloaded.timed_pace(30.0, 512) == pytest.approx(16384.0)


def test_a_pace_timed_on_short_rows_is_not_trusted_for_rows_over_twice_as_long() -> None:
    """Review h223: rows longer than the spell's may go slower a token (attention, padding); its pace was applied to
    them in full for a minute."""
    queue = _timed_queue()
    assert queue.timed_pace(10.0, 1024) == pytest.approx(16384.0)  # twice as long: like work
    assert queue.timed_pace(10.0, 1025) == 0.0
    assert queue.timed_pace(10.0, 256) == pytest.approx(8192.0)  # shorter: no more rows a second than the spell's


async def test_ten_concurrent_requests_of_64_long_inputs_a_timed_box_starts_within_the_bound_are_answered(
    start_box,
) -> None:
    """Tester h214's burst through a box: a model timed on one request of 64 inputs of 400 words (0.6 s), then 10
    such at once, 6 s of its work, within the 10 s bound: all are answered. The holders' pace, halved, let in 5 s of
    it with the requests' own work counted, and the rest were refused. A no-op model (embeddings: the admission of
    an encoder's requests is the same whatever its task), so its cost is set, not the CPU's."""
    from appliance.settings import ModelEntry
    from tests.conftest import url

    # 64 rows of 402 tokens, in batches of 40 and 24 rows (16,384 tokens): 2 × 5 ms + 25,728 × 23 us, 0.6 s.
    costs = {"cost_ms": 5, "cost_per_token_us": 23}
    model = ModelEntry(name="long", runtime="noop", pinned=True, options=costs)
    box = await start_box(default_model=False, models=[model])
    body = {"model": "long", "input": [" ".join(["word"] * 400)] * 64, "timeout": 60}
    unlimited = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=unlimited, timeout=aiohttp.ClientTimeout(total=90)) as http:

        async def one() -> tuple[int, str]:
            async with http.post(url(box, "/v1/embeddings"), json=body) as response:
                return response.status, (await response.text())[:300]

        assert (await one())[0] == 200
        await asyncio.sleep(3.0)  # idle: the rate measured in that spell is forgotten, its pace is not
        outcomes = await asyncio.gather(*(one() for _ in range(10)))
    assert [status for status, _ in outcomes] == [200] * 10, outcomes
