"""The requests waiting to join a generate runtime's decode batch, and the cancels waiting to apply.

The one idea: every thread may add or cancel, only the stepping thread takes, and all of it happens
under one lock here, so the stepping thread owns the decode batch outright. A request is taken at a
step boundary (in arrival order, as many as the batch has room for), or cancelled before it joins;
one taken for a step that failed before it ran is put back, to be taken again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar


class _HasId(Protocol):
    @property
    def request_id(self) -> str: ...


R = TypeVar("R", bound=_HasId)


class Inbox(Generic[R]):
    """Requests queued to join, the ids cancelled since the last step, and every id not yet finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[R] = deque()
        self._cancelled: set[str] = set()
        self._ids: set[str] = set()  # every request waiting or decoding

    def add(self, request: R) -> None:
        with self._lock:
            if request.request_id in self._ids:
                raise ValueError(f"request {request.request_id!r} is already generating")
            self._ids.add(request.request_id)
            self._pending.append(request)

    def cancel(self, request_id: str) -> None:
        """Drop it at the next step boundary, waiting or decoding; an unknown id is ignored."""
        with self._lock:
            if request_id in self._ids:
                self._cancelled.add(request_id)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._ids)

    def waiting(self) -> list[R]:
        """The requests waiting to join, as of now."""
        with self._lock:
            return list(self._pending)

    def take(self, room: int, max_tokens: int, size: Callable[[R], int]) -> tuple[list[R], set[str]]:
        """At a step boundary: the cancels since the last one (applied to those waiting), and up to
        `room` waiting requests in arrival order, within `max_tokens` of prompt (the first always)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                self._pending = deque(r for r in self._pending if r.request_id not in cancelled)
                self._ids -= cancelled
            joining: list[R] = []
            tokens = 0
            while self._pending and len(joining) < room:
                tokens += size(self._pending[0])
                if joining and tokens > max_tokens:
                    break
                joining.append(self._pending.popleft())
        return joining, cancelled

    def put_back(self, joining: Iterable[R]) -> None:
        """Taken for a step that failed before they ran: first in line again, in their order."""
        with self._lock:
            self._pending.extendleft(reversed(list(joining)))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Finished or dropped while decoding: no longer the runtime's."""
        ids = set(request_ids)
        with self._lock:
            self._ids -= ids
            self._cancelled -= ids

    def forget_running(self) -> list[str]:
        """Forget every request not waiting to join (after a failed step: the decode batch, and any
        request that ran in it); their ids, sorted."""
        with self._lock:
            running = self._ids - {r.request_id for r in self._pending}
            self._ids -= running
            self._cancelled -= running
        return sorted(running)

    def clear(self) -> list[str]:
        """Drop every request, waiting or decoding; their ids, sorted."""
        with self._lock:
            dropped = sorted(self._ids)
            self._pending.clear()
            self._cancelled.clear()
            self._ids.clear()
        return dropped
