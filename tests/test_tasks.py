"""Background tasks end when told to, even when a cancellation is lost on the way."""

from __future__ import annotations

import asyncio

from appliance.tasks import cancel_and_wait


async def test_a_task_that_loses_a_cancellation_is_cancelled_again() -> None:
    """Python 3.11's wait_for drops a cancel that meets its result; the loop must still end."""
    lost = 0

    async def loop_that_lost_one() -> None:
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if lost == 0:
                    lost += 1
                    asyncio.current_task().uncancel()  # what a wait_for returning its result amounts to
                    continue
                raise

    task = asyncio.create_task(loop_that_lost_one())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task, None]), 2.0)
    assert task.cancelled() and lost == 1
