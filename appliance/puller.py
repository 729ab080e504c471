"""Pulling from a shared durable consumer exactly as much as this box has room for.

The rule: at most one pull request is open per consumer, sized to the room at the moment it is
sent; when it is filled, expires, or ends with a status, the next one is sized afresh. A busy box
asks for little or nothing, an idle one for a lot, and JetStream hands each message to exactly
one of the boxes asking: the queue balances the fleet without anyone tracking worker state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.nuid import NUID

from appliance import bus
from appliance.envelope import BATCH, INTERACTIVE
from appliance.tasks import Background, cancel_and_wait

_SHORTEST_S = 0.005  # a pull request's shortest life
_DRAIN_S = 2.0  # a stop's wait for what the server sent before it heard the stop
_HAND_BACK_S = 1.0  # and for the naks of what came then to be sent
_INBOXES = NUID()  # each puller's own inbox: a stopped one's stragglers are never another's
BULK_IDLE_S = 0.05  # interactive silence needed before batch-priority work is pulled


class Puller:
    """Keeps at most one pull request open for one model, sized to the room the box has now."""

    def __init__(
        self,
        nc: NATS,
        slug: str,
        inbox: str,
        room: Callable[[], int],
        on_message: Callable[[Msg], None],
        *,
        priority: str = INTERACTIVE,
        expires_s: float = 2.0,
        idle_poll_s: float = 1.0,
        room_opens_in: Callable[[], float | None] | None = None,
        room_lasts: Callable[[], float | None] | None = None,
        keeps: Callable[[Msg], bool] | None = None,
        hand_back: Callable[[Msg], Awaitable[None]] | None = None,
    ) -> None:
        self._nc = nc
        # What arrives after a stop goes back to the queue so (`delivery.HandBack`; a nak by default).
        self._give_back = hand_back or _nak
        self._subject = bus.pull_request_subject(slug, priority)
        self._inbox = f"{inbox}.{_INBOXES.next().decode()}"
        self._expires_s = expires_s
        self._idle_poll_s = idle_poll_s  # how often to reconsider when there was no room
        self.last_message_at = 0.0  # loop time of the last request delivered
        self._room = room
        # Room that grows with time alone (a batch on the device nearing its end) says when to look again.
        self._room_opens_in = room_opens_in
        self._room_lasts = room_lasts  # a room that ends sooner than `expires_s` ends its request then
        self._on_message = on_message
        # Whether the box keeps a message that came after the stop: a redelivery of a request it holds, under its
        # keep-alive (handed back, another box computed it again). The rest is handed back (`_handed_back`).
        self._keeps = keeps or (lambda msg: False)
        self._handed_back = Background("pulled after the stop: handed back")
        self._arrived = asyncio.Event()  # set as each message is taken in (a stop waits for the last)
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._wake = asyncio.Event()
        self._seq = 0
        self._remaining = 0  # messages the open request may still deliver
        self._open_until = 0.0  # loop time the open request expires (plus grace)

    async def start(self) -> None:
        """Subscribe to its inbox and start asking; not once stopped, also by a stop that came while it subscribed
        (it left a puller pulling for a model whose runtime its eviction closed: tester h95)."""
        if self._stopped:
            return
        sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._receive)
        if self._stopped:
            await sub.unsubscribe()
            return
        self._sub = sub
        self._task = asyncio.create_task(self._loop(), name=f"puller:{self._subject}")

    async def stop(self) -> None:
        """Stop asking, for good. What the server sent before it heard this box stop listening is handed back (a nak)
        for another box to take at once: unsubscribed, the client dropped it, and JetStream gave it out again only
        after `ack_wait_s` (tester h104: past a stopping gateway's grace, so its client had a 503)."""
        self.halt()
        sub, self._sub = self._sub, None  # taken before any wait: whatever cuts the stop short, it is unsubscribed
        try:
            await cancel_and_wait([self._task])
            if sub is not None:
                async with asyncio.timeout(_DRAIN_S):  # not wait_for (see appliance/tasks.py)
                    await self._take_in_flight(sub)
        except (TimeoutError, NatsError):  # cut off from NATS, or it stalls: what comes later waits out ack_wait_s
            pass
        finally:
            if sub is not None:
                with suppress(NatsError):
                    # Out of the client's table too: left there, a reconnect subscribed it again (review).
                    await sub.unsubscribe()
        await self._handed_back.wait(_HAND_BACK_S)
        await self._handed_back.cancel()  # against a stalled server: what is not sent by now waits out ack_wait_s

    def halt(self) -> None:
        """Stop asking now, without a wait (`stop` then hands back what came): a stop cut short by a cancel cannot
        leave a puller asking (`stop_pullers`)."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    async def _take_in_flight(self, sub: Subscription) -> None:
        """Tell the server to stop sending to the inbox, then take in what it sent before it heard that: a marker
        published after the unsubscribe comes back after all of it (a server answers a connection in order), and
        their callbacks have run once the subscription's queue is empty. Not `sub.drain()`: its round trip is
        `nc.flush()`, which on a timeout (or cancelled at a bound) leaves its PONG's waiter cancelled, and the late
        PONG then stops nats-py's read loop for good (2.16): a box deaf to NATS while it says it is connected
        (review, a nats-server stalled over 2 s)."""
        marked = asyncio.Event()

        async def mark(_msg: Msg) -> None:
            marked.set()

        marker_subject = self._nc.new_inbox()
        marker = await self._nc.subscribe(marker_subject, cb=mark)
        try:
            # nats-py has no public call that tells the server alone: `unsubscribe` drops what is on its way too.
            await self._nc._send_unsubscribe(sub._id)
            await self._nc.publish(marker_subject, b"")
            await marked.wait()
            while sub.pending_msgs:
                self._arrived.clear()
                await self._arrived.wait()
        finally:
            with suppress(NatsError):
                await marker.unsubscribe()

    def quiet_for(self, seconds: float) -> bool:
        """No message has been delivered for `seconds`: the box may turn to batch-priority work."""
        return asyncio.get_running_loop().time() - self.last_message_at >= seconds

    def poke(self) -> None:
        """Room may have grown: consider asking for more."""
        self._wake.set()

    def pull_again(self) -> None:
        """The server lost the open pull request (a restart; the consumers are made again): ask anew now, not once
        the lost one would have expired, seconds later."""
        self._remaining = 0
        self._wake.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if self._remaining > 0 and now >= self._open_until:
                self._remaining = 0  # its end-of-request status was lost (e.g. a reconnect)
            if self._remaining == 0:
                want = self._room()
                if want > 0 and self._nc.is_connected:
                    await self._request(want, loop)
            self._wake.clear()
            timeout = max(0.01, self._open_until - loop.time()) if self._remaining else self._idle_wait_s()
            try:  # not wait_for: on Python 3.11 it swallows a cancel that meets a wake, and stop() waited for ever
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _idle_wait_s(self) -> float:
        opens_in = self._room_opens_in() if self._room_opens_in is not None else None
        return self._idle_poll_s if opens_in is None else min(self._idle_poll_s, max(0.001, opens_in))

    async def _request(self, batch: int, loop: asyncio.AbstractEventLoop) -> None:
        self._seq += 1
        self._remaining = batch
        lasts = self._room_lasts() if self._room_lasts is not None else None
        expires_s = self._expires_s if lasts is None else min(self._expires_s, max(_SHORTEST_S, lasts))
        self._open_until = loop.time() + expires_s + 1.0
        payload = orjson.dumps({"batch": batch, "expires": int(expires_s * 1e9)})
        await self._nc.publish(self._subject, payload, reply=f"{self._inbox}.{self._seq}")

    async def _receive(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is not None and not msg.data:
            # 408 (expired), 409 (limits) or 404 end a pull request; 100 is a heartbeat.
            if status != "100" and msg.subject.endswith(f".{self._seq}"):
                self._remaining = 0
                self._wake.set()
            if self._stopped:
                self._arrived.set()
            return
        if self._stopped:  # sent before the server heard the stop: another box takes it now
            if not self._keeps(msg):  # not awaited: a stop reads an empty queue as all taken in
                self._handed_back.spawn(self._hand_back(msg))
            self._arrived.set()
            return
        self._remaining = max(0, self._remaining - 1)
        self.last_message_at = asyncio.get_running_loop().time()
        if self._remaining == 0:
            self._wake.set()
        self._on_message(msg)

    async def _hand_back(self, msg: Msg) -> None:
        with suppress(NatsError):  # cut off from NATS: JetStream gives it out again after ack_wait_s
            await self._give_back(msg)


async def stop_pullers(pullers: Iterable[Puller]) -> None:
    """Stop every one of `pullers`: all stop asking at once, then hand back what they were sent, together. One after
    the other, a cancel of the caller while the first waited on a stalled server (a `Background.cancel`, which cancels
    again every 50 ms) left the rest pulling and subscribed (review)."""
    pullers = list(pullers)
    for puller in pullers:
        puller.halt()
    stops = asyncio.gather(*(puller.stop() for puller in pullers))
    await asyncio.shield(stops)  # a cancel of the caller leaves them to finish (bounded: `_DRAIN_S`, `_HAND_BACK_S`)


def bulk_puller(
    nc: NATS,
    box_id: str,
    slug: str,
    room: Callable[[], int],
    on_message: Callable[[Msg], None],
    keeps: Callable[[Msg], bool] | None = None,
    *,
    hand_back: Callable[[Msg], Awaitable[None]] | None = None,
) -> Puller:
    """The puller of a model's batch-priority subject: short requests, looked at often, so bulk work
    starts soon after interactive work goes quiet and stops soon after it returns."""
    return Puller(
        nc,
        slug,
        bus.pull_inbox(box_id, slug, BATCH),
        room,
        on_message,
        priority=BATCH,
        expires_s=0.5,
        idle_poll_s=BULK_IDLE_S,
        keeps=keeps,
        hand_back=hand_back,
    )


async def _nak(msg: Msg) -> None:
    await msg.nak()
