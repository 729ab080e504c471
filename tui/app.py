"""The fleetbox TUI: a Textual app that watches a fleet and steers it, attached or embedded.

The app owns one refresh loop: every `refresh_s` it takes a view from its source (an in-memory
assembly, no round trip), feeds the event log and the throughput history, and lets the visible
screen re-render what changed. Actions run as Textual workers, so a slow box never freezes the
screen, and the event loop it shares with a serving box (`fleetbox serve --tui`) stays free.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from nats.errors import Error as NatsError
from textual.app import App
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches

from appliance.errors import FleetboxError
from tui.dialogs import DIALOG_KEYS, Confirm, Dialog, KeysHelp
from tui.events import Event, EventLog, Throughput
from tui.model import FleetView
from tui.screens import DataScreen, EventsScreen, FleetScreen, ModelsScreen, QueueScreen
from tui.screens.base import TABLE_KEYS
from tui.source import FleetSource

SCREENS: dict[str, type[DataScreen]] = {
    "fleet": FleetScreen,
    "models": ModelsScreen,
    "queue": QueueScreen,
    "events": EventsScreen,
}


class FleetboxApp(App[None]):
    TITLE = "fleetbox"
    MODES: ClassVar[dict[str, Any]] = dict(SCREENS)
    DEFAULT_MODE = "fleet"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "switch_mode('fleet')", "Fleet"),
        Binding("2", "switch_mode('models')", "Models"),
        Binding("3", "switch_mode('queue')", "Queue"),
        Binding("4", "switch_mode('events')", "Events"),
        Binding("question_mark", "keys", "Keys", key_display="?"),
        Binding("q", "quit", "Quit"),  # and ctrl+q, Textual's own binding, which works in the dialogs too
    ]
    _SCREEN_KEYS = ("switch_mode", "keys")  # not while a dialog waits for its answer

    def __init__(
        self,
        source: FleetSource,
        *,
        refresh_s: float = 1.0,
        embedded: bool = False,
        theme: str = "ansi-dark",
    ) -> None:
        super().__init__()
        self.source = source
        self.embedded = embedded  # quitting stops the box this app runs inside
        self._refresh_s = refresh_s
        self._theme_name = theme
        self.events = EventLog()
        self.throughput = Throughput()
        self.view = FleetView(address="", taken_at=time.time(), waiting_for="starting…")

    def on_mount(self) -> None:
        self.theme = self._theme_name  # ansi themes draw in the terminal's own colours
        self.tick()
        if self._refresh_s > 0:
            self.set_interval(self._refresh_s, self.tick, name="refresh")

    def tick(self) -> None:
        """Take a fresh view and show it; called by the refresh timer and after every action."""
        view = self.source.view()
        self.events.observe(view)
        self.throughput.record(view)
        self.view = view
        for screen in self.screen_stack:
            if isinstance(screen, DataScreen) and screen.is_mounted:
                try:
                    screen.show(view)
                except NoMatches:  # the screen is being taken down (the app is quitting): nothing to show
                    continue

    def act(self, what: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Run one action in the background; its result or error becomes a notification and an event."""
        self.run_worker(self.attempt(what, call), group="actions", exit_on_error=False)

    async def attempt(self, what: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> str | None:
        """Run one action now, notify and log its result; returns why it failed, or None."""
        self.notify(f"{what}…", timeout=2)
        try:
            result = await call()
        except FleetboxError as exc:
            self._report(what, exc.message, error=True)
            return exc.message
        except (NatsError, TimeoutError, OSError) as exc:
            self._report(what, repr(exc), error=True)
            return repr(exc)
        self._report(what, describe(result), error=False)
        self.tick()
        return None

    def _report(self, what: str, outcome: str, *, error: bool) -> None:
        text = f"{what}: {outcome}"
        self.notify(text, severity="error" if error else "information", timeout=8 if error else 4)
        self.events.add(Event(time.time(), "error" if error else "action", what, text))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """While a dialog is open its keys are the ones that count (and the ones its footer shows)."""
        if action in self._SCREEN_KEYS and isinstance(self.screen, Dialog):
            return False
        return True

    def action_keys(self) -> None:
        sections: list[tuple[str, list[tuple[str, str]]]] = [("anywhere", _keys(self.BINDINGS))]
        sections.append(("tables", list(TABLE_KEYS)))
        for name, screen in SCREENS.items():
            keys = _keys(screen.__dict__.get("BINDINGS", []))  # its own keys, not Screen's focus keys
            if keys:
                sections.append((name, keys))
        sections.append(("dialogs", list(DIALOG_KEYS)))
        self.push_screen(KeysHelp(sections))

    async def action_quit(self) -> None:
        if not self.embedded:
            self.exit()
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.exit()

        await self.push_screen(Confirm("Stop serving on this box and quit?", yes="Stop"), answered)


def _keys(bindings: list[BindingType]) -> list[tuple[str, str]]:
    """(key, what it does) per binding; the mode keys 1 to 4 share one line, `q` names ctrl+q too."""
    keys: list[tuple[str, str]] = []
    modes: list[tuple[str, str]] = []
    for binding in bindings:
        if not isinstance(binding, Binding):
            continue
        key = binding.key_display or binding.key
        if binding.action.startswith("switch_mode"):
            modes.append((key, binding.description))
            continue
        if binding.action == "quit":
            key = f"{key}, ctrl+q"
        keys.append((key, binding.tooltip or binding.description))
    if modes:
        keys.insert(0, (" ".join(k for k, _ in modes), ", ".join(d for _, d in modes)))
    return keys


def describe(result: dict[str, Any]) -> str:
    """A one-line summary of a control verb's answer."""
    if "evicted_from" in result:
        boxes = result["evicted_from"]
        return f"evicted from {', '.join(boxes)}" if boxes else "it was not resident"
    parts = []
    if result.get("state") == "resident":
        parts.append("resident")
    if "pinned" in result:
        parts.append("pinned" if result["pinned"] else "unpinned")
    if result.get("draining"):
        parts.append("draining")
    if "task" in result:
        parts.append(f"registered ({result['task']})")
    if result.get("deleted"):
        parts.append("deleted")
    if result.get("not_held_by"):  # a pin some boxes cannot hold beside their own pinned models (pin_fits.py)
        parts.append(f"not held by {', '.join(sorted(result['not_held_by']))} (too little memory)")
    if result.get("load_failed_on"):  # a pin of a model whose last load failed there: tried again, likely to fail
        parts.append(f"its last load failed on {', '.join(sorted(result['load_failed_on']))} (see its load_error)")
    by = f" (answered by {result['box']})" if result.get("box") else ""
    return (", ".join(parts) or "done") + by
