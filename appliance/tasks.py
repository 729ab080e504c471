"""Background tasks: owned, their failures logged, and stopped for sure.

On Python 3.11, `asyncio.wait_for` returns its result and drops a cancellation that arrives as its
inner future completes, and nats-py's requests are `wait_for`s. A loop cancelled at that moment
never learns it was cancelled: it sleeps and runs again, and whoever awaits it waits for ever
(a box's stop hung this way in the test suite, in `RequestQueue.watch`). So a task is cancelled
again until it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from appliance.errors import NotFound, UnloadedWhileStarting

log = logging.getLogger(__name__)

_AGAIN_S = 0.05  # how long a cancelled task gets before it is cancelled again


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None]) -> None:
    """Cancel the tasks and wait until every one has ended, cancelling again any that carries on."""
    pending = {task for task in tasks if task is not None and not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_AGAIN_S)


class Background:
    """The tasks one object starts and owns: kept until done, a failure logged, stopped together.

    A task nobody keeps can be garbage-collected mid-run, and one whose exception nobody reads
    fails in silence (a request it was answering then waits out its deadline).
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            # A model deleted or unloaded under the step (a pin or load racing a delete) is an outcome the fleet
            # means: 49 warnings of them in a tester's session of documented races (h89). Anything else warns.
            expected = isinstance(exc, NotFound | UnloadedWhileStarting)
            # str as well as the type: a NATS error's repr is "BadRequestError()", its str says what and why.
            # Which step, too: "TimeoutError(): nats: timeout" alone named nothing to look at (tester h92).
            step = getattr(task.get_coro(), "__qualname__", None) or task.get_name()
            log.log(
                logging.INFO if expected else logging.WARNING,
                "background step ended: the model is gone" if expected else "background step failed",
                extra={"owner": self._owner, "step": step, "error": f"{exc!r}: {exc}"},
            )

    async def wait(self, timeout_s: float | None = None) -> None:
        """Until every task (also those started meanwhile) has ended, or `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._tasks:
                    await asyncio.wait(set(self._tasks))

    async def cancel(self) -> None:
        await cancel_and_wait(list(self._tasks))
