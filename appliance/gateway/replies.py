"""What a gateway is answered: a `Reply`, and the chunks of a streamed answer stitched into one (`StreamWaiter`).

A streamed answer is taken from one box at a time. The one idea: a chunk numbered 0 from another box (or
again from the same one) is the answer started over, because its first box died or handed it back mid-answer
and JetStream redelivered it; from then on only the new box's chunks are taken, and the old box is told to
stop. Any other chunk out of order is a chunk lost in transit, and an answer with a hole in it ends there
with an error instead of passing for a whole one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from appliance.envelope import ReplyMeta
from appliance.errors import FleetboxError, ServiceUnavailable, error_from_reply


@dataclass(slots=True, frozen=True)
class Reply:
    meta: ReplyMeta
    body: bytes
    restarted: bool = False  # the first chunk of an answer started over (its box stopped mid-answer)
    error: FleetboxError | None = None  # this gateway's own error, whole (its Retry-After kept), not a box's reply

    def failure(self) -> FleetboxError:
        """The error a reply that is not a 200 stands for."""
        return self.error or error_from_reply(self.meta.status, self.body, self.meta.retry_after_s)


@dataclass(slots=True, frozen=True)
class Stitched:
    """What one chunk did to a stream: the reply its client is given (None: dropped), the box told to stop (one
    whose answer another box started over), and whether it was a late chunk of such a box (a duplicate)."""

    reply: Reply | None
    replaced: str | None = None
    late: bool = False


@dataclass(slots=True)
class StreamWaiter:
    model: str
    queue: asyncio.Queue[Reply] = field(default_factory=asyncio.Queue)
    box: str | None = None  # the box whose chunks are taken
    next_seq: int = 0  # the chunk expected next from it
    broken: bool = False  # a chunk went missing: the answer cannot be whole
    # When the first and the final chunk came in (monotonic): how long the answer held its decode slot, whatever
    # time its client then took to read it.
    first_at: float | None = None
    final_at: float | None = None

    def stitch(self, meta: ReplyMeta, body: bytes) -> Stitched:
        """Take one chunk of the answer, from whichever box sent it; the caller queues `reply` for its client."""
        restarted, replaced = False, None
        if self.box is None:
            self.box = meta.box
        elif self.box != meta.box or (meta.seq == 0 and self.next_seq > 0):
            if meta.seq != 0:
                return Stitched(None, late=True)
            # A box starts the answer over: the first one died (or handed it back) mid-answer, and JetStream
            # redelivered the request. Its chunks, and no more of the first's, are taken. The first, if it still
            # generates (a copy of a request the gateway published again when the queue was lost, pulled by another
            # box: review r41), is told to stop; it tells no other box. Dropping the second box's chunks instead
            # took a box's handback after a drain for such a copy, and hung (review r42).
            replaced = self.box if self.box != meta.box else None
            self.box, self.next_seq, self.broken, restarted = meta.box, 0, False, True
        if self.broken:
            return Stitched(None, replaced)
        if meta.seq != self.next_seq:
            # Chunks are published in order on one connection: a gap is a chunk lost in transit (a NATS failover),
            # and an answer with a hole in it must not pass for a whole one.
            self.broken = True
            lost = ServiceUnavailable(
                f"chunk {self.next_seq} of the answer from box {meta.box} was lost in transit; send the request again",
                code="chunk_lost",
            )
            meta, body = replace(meta, status=lost.status, final=True), lost.to_json()
        self.next_seq = meta.seq + 1
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        if meta.final:
            self.final_at = now
        return Stitched(Reply(meta, body, restarted), replaced)
