"""Snapshots of every TUI screen at 80×24, against a fake fleet (tests/tui_fake.py).

The data source is a fake on purpose: these tests check the screens (layout, marks, bars, the
sparkline, the dialogs), so the fleet behind them is a fixed script of views with fixed clocks.
`tests/test_tui_live.py` drives the same app against a real NATS and a real box. Update the
snapshots with `pytest tests/test_tui_snapshots.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from textual.pilot import Pilot

from tests.tui_fake import FakeSource
from tui.app import FleetboxApp


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    """Event times are local; pin the zone so the snapshots do not depend on the machine's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TZ", "UTC")
        time.tzset()
        yield
    time.tzset()


def scripted_app() -> tuple[FleetboxApp, FakeSource]:
    source = FakeSource()
    return FleetboxApp(source, refresh_s=0), source  # no timer: the test decides when views arrive


async def play_script(pilot: Pilot) -> None:
    """Feed every scripted view, so the events and the throughput history are complete."""
    app = pilot.app
    assert isinstance(app, FleetboxApp) and isinstance(app.source, FakeSource)
    while not app.source.exhausted:
        app.tick()
    app.tick()


@pytest.mark.parametrize(
    "press",
    [
        pytest.param((), id="fleet"),
        pytest.param(("2",), id="models"),
        pytest.param(("3",), id="queue"),
        pytest.param(("4",), id="events"),
        pytest.param(("question_mark",), id="keys"),
        pytest.param(("2", "r"), id="register-form"),
        pytest.param(("1", "d"), id="drain-confirmation"),
    ],
)
def test_screen_snapshot(snap_compare, press: tuple[str, ...]) -> None:
    app, _ = scripted_app()
    assert snap_compare(app, press=press, terminal_size=(80, 24), run_before=play_script)


def test_model_actions_on_the_fake_fleet_ask_the_right_box() -> None:
    """The keys reach `ops` with the model and box on screen (the live test checks the box's side)."""
    app, source = scripted_app()

    async def drive(pilot: Pilot) -> None:
        await play_script(pilot)
        await pilot.press("2", "down", "e", "y")  # bge-reranker-base, held by one live box
        await pilot.press("down", "l", "down", "enter")  # distilbert-sst2 on the first box offered
        await pilot.press("1", "d", "y")  # the first box
        await pilot.press("down", "down", "l")  # a gateway runs no models: refused on screen
        await app.workers.wait_for_complete()
        app.exit()

    app.run(headless=True, size=(80, 24), auto_pilot=drive)
    assert source.ops.calls == [
        ("evict", ("bge-reranker-base", "gpu-a-7f3k2q")),
        ("load", ("distilbert-sst2", "gpu-a-7f3k2q")),
        ("drain", "gpu-a-7f3k2q"),
    ]
