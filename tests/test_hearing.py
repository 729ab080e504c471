"""When each box's heartbeat last reached this one (`Hearing`), on a clock the test moves."""

from __future__ import annotations

import pytest

from appliance import hearing
from appliance.hearing import Hearing


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(hearing.time, "monotonic", lambda: now[0])
    return now


def test_a_box_is_gone_after_twice_the_ttl_unheard_from_a_sound_view(clock: list[float]) -> None:
    heard = Hearing("me", ttl_s=1.0)
    heard.watching()
    heard.heard("gw")
    clock[0] += 1.5
    heard.heard("me")
    assert not heard.gone("gw")  # the watch has not run twice the TTL
    clock[0] += 0.9
    heard.heard("me")
    assert heard.gone("gw")
    clock[0] += 1.5
    assert not heard.gone("gw")  # this box's own record is not arriving: its view is not sound


def test_boxes_unheard_for_long_are_forgotten_and_judged_the_same(clock: list[float]) -> None:
    """Review h202: one entry was kept for each box id ever heard (gateways restarting under new ids)."""
    heard = Hearing("me", ttl_s=1.0)
    heard.watching()
    for n in range(100):
        heard.heard(f"gw-{n}")
    for _ in range(4):
        clock[0] += 0.9
        heard.heard("me")
        heard.heard("live")
    assert set(heard._at) == {"me", "live"}
    assert heard.gone("gw-7") and not heard.gone("live")


def test_a_run_is_over_once_a_record_of_another_run_of_its_box_arrives(clock: list[float]) -> None:
    """A box restarted under its id: its last run's requests have nobody awaiting them, though the id is heard."""
    heard = Hearing("me", ttl_s=1.0)
    heard.watching()
    heard.heard("gw", "a")
    assert not heard.ended("gw", "a")
    assert not heard.ended("gw", "b")  # a run not heard yet (its request came before its first record) is not over
    heard.heard("gw", "b")
    assert heard.ended("gw", "a") and not heard.ended("gw", "b")
    heard.heard("gw", "a")  # beats again: two boxes under one id (a start refuses the second)
    assert not heard.ended("gw", "a") and heard.ended("gw", "b")
    heard.heard("old", "")  # a box that names no run: nothing is over
    heard.heard("old", "")
    assert not heard.ended("old", "")


def test_runs_are_remembered_beyond_any_request_then_forgotten(clock: list[float]) -> None:
    heard = Hearing("me", ttl_s=1.0)
    heard.heard("gw", "a")
    heard.heard("gw", "b")
    clock[0] += 10.0  # gone long past twice the TTL, and not forgotten yet: its runs outlive its hearing
    heard.heard("me", "m")
    assert heard.ended("gw", "a")
    clock[0] += hearing.RUN_MEMORY_S  # the default; a box remembers as long as its stream keeps a request
    heard.heard("me", "m")
    assert not heard.ended("gw", "a") and "gw" not in heard._runs
