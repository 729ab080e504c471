"""What a gateway is answered: a `Reply`, and the chunks of a streamed answer stitched into one (`StreamWaiter`).

A streamed answer is taken from one box at a time. The one idea: a chunk numbered 0 from another box (or
again from the same one) is the answer started over, because its first box died or handed it back mid-answer
and JetStream redelivered it; from then on only the new box's chunks are taken, and the old box is told to
stop. Any other chunk out of order is a chunk lost in transit (a NATS failover): an answer with a hole in it
must not pass for a whole one, so while its box still generates it (the chunk is not its last) the box is asked
to hand the request back, to be generated again from the start and replayed as after a box death; if it
cannot, or the chunk was its last, the answer ends there with an error.
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
    whose answer another box started over), whether it was a late chunk of such a box (a duplicate), and, when a
    chunk was lost while its box still generates, the error the client is given if that box cannot hand the
    request back (`lost`: the caller asks it, `Waiters.take`)."""

    reply: Reply | None
    replaced: str | None = None
    late: bool = False
    lost: Reply | None = None


@dataclass(slots=True)
class StreamWaiter:
    model: str
    queue: asyncio.Queue[Reply] = field(default_factory=asyncio.Queue)
    box: str | None = None  # the box whose chunks are taken
    next_seq: int = 0  # the chunk expected next from it
    broken: bool = False  # a chunk went missing: the answer cannot be whole unless it starts over
    restarts: int = 0  # the times a box started the answer over
    # When the first and the final chunk came in (monotonic): how long the answer held its decode slot, whatever
    # time its client then took to read it.
    first_at: float | None = None
    final_at: float | None = None
    last_at: float | None = None  # the latest chunk taken: a box that died with a lost queue falls silent

    def stitch(self, meta: ReplyMeta, body: bytes) -> Stitched:
        """Take one chunk of the answer, from whichever box sent it; the caller queues `reply` for its client."""
        restarted, replaced = False, None
        if self.box is None:
            self.box = meta.box
        elif self.box != meta.box or (meta.seq == 0 and (self.next_seq > 0 or self.broken)):
            if meta.seq != 0:
                return Stitched(None, late=True)
            # A box starts the answer over: the first one died (or handed it back) mid-answer, and JetStream
            # redelivered the request. Its chunks, and no more of the first's, are taken. The first, if it still
            # generates (a copy of a request the gateway published again when the queue was lost, pulled by another
            # box: review r41), is told to stop; it tells no other box. Dropping the second box's chunks instead
            # took a box's handback after a drain for such a copy, and hung (review r42). A broken answer whose box
            # handed it back starts over so too, on whichever box pulled it (this one, maybe).
            replaced = self.box if self.box != meta.box else None
            self.box, self.next_seq, self.broken, restarted = meta.box, 0, False, True
            self.restarts += 1
        if self.broken:
            return Stitched(None, replaced)
        if meta.seq != self.next_seq:
            # Chunks are published in order on one connection: a gap is a chunk lost in transit (a NATS failover).
            # Its box still generates the answer unless this is its last chunk: it may hand it back to start over
            # (after the failover, 23 of 120 streams lost their chunk 0 and ended 503 with nothing sent).
            self.broken = True
            error = ServiceUnavailable(
                f"chunk {self.next_seq} of the answer from box {meta.box} was lost in transit; send the request again",
                code="chunk_lost",
            )
            lost = Reply(replace(meta, status=error.status, final=True), error.to_json(), restarted, error)
            if not meta.final:
                return Stitched(None, replaced, lost=lost)
            meta, body = lost.meta, lost.body
        self.next_seq = meta.seq + 1
        now = time.monotonic()
        self.last_at = now
        if self.first_at is None:
            self.first_at = now
        if meta.final:
            self.final_at = now
        return Stitched(Reply(meta, body, restarted), replaced)
