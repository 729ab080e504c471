"""The requests one generation worker holds, each in the table of what is being done with it.

The one idea: whichever table holds a request, its message is kept in progress and a redelivery of it is known as
the worker's own: being admitted (`preparing`), generating (`streams`), its last chunk awaiting its gateway
(`settling`), or being given another try or dead-lettered (`retrying`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from appliance.envelope import RequestMeta

if TYPE_CHECKING:
    from appliance.adapters import LoadedAdapter


@dataclass(slots=True)
class Stream:
    """A request in the decode batch: the chunks sent to its gateway so far, and the tokens made."""

    meta: RequestMeta
    msg: Msg
    seq: int = 0
    tokens: int = 0
    adapter: LoadedAdapter | None = None  # the LoRA adapter's load it runs with


class HeldGenerations:
    """The tables of one generative model's worker on this box, and what it asks of them all at once."""

    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self.preparing: dict[str, Msg] = {}  # request id -> its message, while admitted (blob, adapter, prompt)
        # Requests whose last chunk (or error) waits for its gateway's confirmation, by id: no longer in the decode
        # batch, yet not acked, so the worker keeps them in progress and knows a redelivery of one as its own. Left
        # out, a final chunk that waited out `ack_wait` (a gateway reconnecting) was delivered again, generated again
        # on every delivery, then dead-lettered: its client told 422 for an answered request (review h122).
        self.settling: dict[str, Msg] = {}
        # Requests being given another try or dead-lettered (`retry_or_dead_letter`), kept in progress meanwhile but,
        # unlike those settling, never handed back at a drain: one in FBX_DLQ, its client maybe told, would be queued
        # afresh for `max_deliver` more tries (review h133). Cut off, the max-deliveries advisory settles it.
        self.retrying: dict[str, Msg] = {}
        self.idle = asyncio.Event()  # set whenever no stream is active, for drain
        self.idle.set()

    @property
    def count(self) -> int:
        """Those generating or being admitted: what takes the worker's room."""
        return len(self.streams) + len(self.preparing)

    def running(self) -> int:
        return sum(1 for stream in self.streams.values() if stream.tokens)

    def messages(self) -> list[Msg]:
        """Every request this worker holds, kept in progress: those generating, those being admitted, whose adapter
        load (one at a time per base) or prompt rendering can outlast `ack_wait` too, those whose last chunk waits
        for its gateway, and those being given another try or dead-lettered."""
        streams = [stream.msg for stream in self.streams.values()]
        return [*streams, *self.preparing.values(), *self.settling.values(), *self.retrying.values()]

    def copy_of(self, request_id: str) -> Msg | None:
        """The message of a request this worker holds (generating, being admitted, its last chunk settling, or being
        given another try or dead-lettered: taken in afresh meanwhile, it was generated beside its dead letter,
        review h145)."""
        if request_id in self.streams:
            return self.streams[request_id].msg
        if request_id in self.preparing:
            return self.preparing[request_id]
        if request_id in self.settling:
            return self.settling[request_id]
        return self.retrying.get(request_id)

    def take_copy(self, request_id: str, msg: Msg) -> None:
        """`msg` is held in place of the copy `copy_of` names (one published again after the queue was lost)."""
        if request_id in self.streams:
            self.streams[request_id].msg = msg
        elif request_id in self.preparing:
            self.preparing[request_id] = msg
        elif request_id in self.settling:
            self.settling[request_id] = msg
        else:
            self.retrying[request_id] = msg

    def generating(self, stream: Stream) -> None:
        self.streams[stream.meta.id] = stream
        self.idle.clear()

    def forget(self, request_id: str) -> Stream | None:
        stream = self.streams.pop(request_id, None)
        if not self.streams:
            self.idle.set()
        return stream
