"""This box's own heartbeat record in `fbx_boxes` (`OwnRecord`): who holds this box's id.

The one idea: a box writes under its id only over a revision read from the bucket, never judged from the watch. At
start it takes the id over none, a dead box's record or its own from before a reopen (`take`); each beat after that
writes over its own last record alone (`write`). A record of another start there means another live box beats under
this id: `Conflict`, and the box that meets it stops (refused at start) or stops beating (woken after its id was
taken while it was frozen).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import orjson
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from appliance.errors import Conflict

# The lines keep the logger they had when this was part of fleet.py: a log's `logger` field is what an operator
# filters on, and the split changed no behaviour.
log = logging.getLogger("appliance.fleet")


class OwnRecord:
    def __init__(self, box_id: str, period_s: float, watched: Callable[[], dict[str, Any] | None]) -> None:
        self._box_id = box_id
        self._period_s = period_s
        self._watched = watched  # the record under this id as the fleet's watch last brought it
        self.started: object = None  # this box's `started`, which its records carry
        self._revision: int | None = None  # of this box's last record: a beat writes over that alone (`write`)

    @property
    def holds(self) -> bool:
        """Whether this box holds its id: its last write under it was made over a record it judged (none, a dead
        box's, or its own). Not after a start whose first write failed on a NATS error (its record unjudged: a twin
        of a live box is refused only at its next beat, review h211), nor after `forget`."""
        return self._revision is not None

    def forget(self) -> None:
        """After a reconnect the bucket may be made anew (a restarted server lost it): the next write reads first."""
        self._revision = None

    async def take(self, kv: KeyValue, started: object, record: Callable[[], bytes]) -> None:
        """Write this box's first record under its id, over none, a dead box's, or its own (a reopen); raise
        `Conflict` when another live box beats under it: two boxes shared one heartbeat and one set of control
        subjects, and one `fleetbox box drain` stopped both (operator tester h60). The record judged is the one read
        from the bucket and the write is made over that revision alone: judged from the watch, two boxes started
        under one id at the same moment could each see none, and one wrote over the other's fresh record (h64)."""
        self.started = started
        for _ in range(3):
            try:
                entry: KeyValue.Entry | None = await kv.get(self._box_id)
            except KeyNotFoundError:  # none, or deleted
                entry = None
            except NatsError as exc:  # the periodic beat writes it; a NATS hiccup is no reason to fail the start
                log.warning("first heartbeat not written", extra={"error": repr(exc)})
                return
            if entry is not None and entry.value:
                if _started(entry.value) == started:  # its own (a reopen)
                    self._revision = entry.revision
                    return
                await self._refuse_a_live_twin(entry.value)
            value = record()
            try:
                if entry is None:
                    self._revision = await kv.create(self._box_id, value)
                else:
                    self._revision = await kv.update(self._box_id, value, last=entry.revision)
                return
            except KeyWrongLastSequenceError:  # written since it was read: judged afresh on the next pass
                continue
            except NatsError as exc:
                log.warning("first heartbeat not written", extra={"error": repr(exc)})
                return
        raise _taken(self._box_id)  # written over three times while this box judged it: boxes beat under it

    async def _refuse_a_live_twin(self, value: bytes) -> None:
        """Raise `Conflict` unless the record `value` of another start is a box that died moments ago (a record
        lives a TTL): it is a live box's if a newer beat of another start comes within two and a half periods."""
        seen = _ts(value)
        loop = asyncio.get_running_loop()
        until = loop.time() + 2.5 * self._period_s
        while loop.time() < until:
            await asyncio.sleep(self._period_s / 4)
            current = self._watched()
            if current is not None and current.get("started") != self.started and _ts(current) > seen:
                raise _taken(self._box_id)

    async def write(self, kv: KeyValue, record: bytes) -> None:
        """Write this box's record over its last one only; `Conflict` when another box's record is there now. A box
        frozen past its TTL (SIGSTOP, a paused VM) whose id a box started meanwhile took wrote over that box's record
        when it woke, and both beat on: every request computed twice (h82)."""
        for _ in range(3):
            if self._revision is not None:
                with suppress(KeyWrongLastSequenceError):
                    self._revision = int(await kv.update(self._box_id, record, last=self._revision))
                    return
            try:
                entry = await kv.get(self._box_id)
            except KeyNotFoundError:  # aged out while this box was cut off or frozen, or deleted: no box took it
                with suppress(KeyWrongLastSequenceError):
                    self._revision = int(await kv.create(self._box_id, record))
                    return
                continue
            if entry.value and _started(entry.value) != self.started:
                raise _taken(self._box_id)
            self._revision = entry.revision  # its own, written by a beat whose answer was lost
        raise RuntimeError("this box's heartbeat record kept changing under it")


def _taken(box_id: str) -> Conflict:
    return Conflict(
        f"box id {box_id} is taken: another live box of the fleet beats under it; give this box another --box-id"
        " (or stop that box)"
    )


def _ts(record: bytes | dict[str, Any]) -> float:
    """When a heartbeat record was written (0 when unreadable)."""
    with suppress(orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return float((orjson.loads(record) if isinstance(record, bytes) else record).get("ts", 0))
    return 0.0


def _started(value: bytes) -> object:
    """The `started` of a heartbeat record (None when unreadable)."""
    with suppress(orjson.JSONDecodeError, AttributeError):
        return orjson.loads(value).get("started")
    return None
