"""The four screens: Fleet (boxes), Models (catalog), Queue (stream and consumers), Events.

A screen renders the app's latest `FleetView` and nothing else; `show(view)` is called on every
refresh and re-renders only cells that changed, keeping the cursor on the same box or model. An
action key opens a dialog when it needs an answer or a confirmation, then hands the call to
`app.act`, which runs it off the screen's path and reports the result in a notification.
"""

from tui.screens.base import DataScreen
from tui.screens.events import EventsScreen
from tui.screens.fleet import FleetScreen
from tui.screens.models import ModelsScreen
from tui.screens.queue import QueueScreen

__all__ = ["DataScreen", "EventsScreen", "FleetScreen", "ModelsScreen", "QueueScreen"]
