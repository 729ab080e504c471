"""Stopping background tasks for sure.

On Python 3.11, `asyncio.wait_for` returns its result and drops a cancellation that arrives as its
inner future completes, and nats-py's requests are `wait_for`s. A loop cancelled at that moment
never learns it was cancelled: it sleeps and runs again, and whoever awaits it waits for ever
(a box's stop hung this way in the test suite, in `Box._watch_stream`). So a task is cancelled
again until it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

_AGAIN_S = 0.05  # how long a cancelled task gets before it is cancelled again


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None]) -> None:
    """Cancel the tasks and wait until every one has ended, cancelling again any that carries on."""
    pending = {task for task in tasks if task is not None and not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_AGAIN_S)
