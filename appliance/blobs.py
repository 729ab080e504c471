"""Large bodies travel beside the queue: the JetStream object store `fbx_blobs`.

A request body (or a reply) over the blob threshold is put in the store under its request id (a
reply's also under the box that answers, `bus.reply_blob_key`: two boxes may answer a redelivered
request) and the message carries only the key (`Fbx-Blob`), so the queue holds small messages whatever
clients send and NATS's payload limit never meets a client's body. The gateway deletes a reply blob once
read, or at once for an answer it drops (a second one); a request blob is deleted when the request is
acked, however it was settled (answered, cancelled, refused, dead-lettered: `Blobs.ack`), and the
bucket's TTL sweeps up what a crash left behind.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from contextvars import ContextVar
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE, ObjectStore

from appliance import bus

# Headers and framing ride along with a body; keep this much of NATS's payload limit for them.
_HEADROOM = 64 * 1024
# A blob read given up (TimeoutError) past this: nats.py's waits for the chunks without end. A body of the largest
# `max_body_bytes` takes well under a second on a live server.
READ_TIMEOUT_S = 30.0


# The subscriptions the object-store read of the running task made (`_KeepsReadSubscriptions`).
_read_subscriptions: ContextVar[list[Subscription] | None] = ContextVar("blob_read_subscriptions", default=None)


class _KeepsReadSubscriptions:
    """The JetStream context the blob store reads through: it notes, for the read running, each subscription made
    (a blob's chunks come through an ordered consumer), so a read cut short can unsubscribe it. nats.py's read does
    so only once the last chunk came: a timed-out read left its subscription on the connection for good."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def subscribe(self, *args: Any, **kwargs: Any) -> Subscription:
        subscription = await self._js.subscribe(*args, **kwargs)
        if (made := _read_subscriptions.get()) is not None:
            made.append(subscription)
        return subscription


class Blobs:
    def __init__(
        self, js: JetStreamContext, threshold: int, max_payload: int, *, ttl_s: float, file_storage: bool, replicas: int
    ) -> None:
        self._js = js
        self.threshold = max(1024, min(threshold, max_payload - _HEADROOM))
        self.message_room = max_payload - _HEADROOM  # the largest body a message carries
        self._ttl_s = ttl_s
        self._file_storage = file_storage
        self._replicas = replicas
        self._store: ObjectStore | None = None
        self._lock = asyncio.Lock()

    def needed(self, body: bytes) -> bool:
        return len(body) > self.threshold

    async def _bucket(self) -> ObjectStore:
        if self._store is not None:
            return self._store
        async with self._lock:
            if self._store is None:
                try:
                    await self._js.object_store(bus.BLOBS_BUCKET)
                except BucketNotFoundError:
                    await self._js.create_object_store(
                        config=ObjectStoreConfig(
                            bucket=bus.BLOBS_BUCKET,
                            ttl=self._ttl_s,
                            storage=StorageType.FILE if self._file_storage else StorageType.MEMORY,
                            replicas=self._replicas,
                        ),
                        bucket=bus.BLOBS_BUCKET,
                    )
                stream = OBJ_STREAM_TEMPLATE.format(bucket=bus.BLOBS_BUCKET)
                self._store = ObjectStore(bus.BLOBS_BUCKET, stream, _KeepsReadSubscriptions(self._js))
            return self._store

    async def put(self, key: str, data: bytes) -> str:
        """Store `data` under `key`. A bucket gone since it was looked up (memory storage does not outlive a
        nats-server restart; an operator may delete it) is looked up, or made, again once: every large body after
        it was a 500 (review r40)."""
        try:
            await (await self._bucket()).put(key, data)
        except NatsError:
            self._store = None
            await (await self._bucket()).put(key, data)
        return key

    async def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """The blob's bytes; TimeoutError past `timeout_s` (default and at most `READ_TIMEOUT_S`). Unbounded, a read
        whose chunks never came (purged under it, a server stalled) held its request forever, its message kept in
        progress by the worker's keep-alive (review h141). A read cut short unsubscribes what it subscribed to."""
        subscriptions: list[Subscription] = []
        reading = _read_subscriptions.set(subscriptions)
        try:
            async with asyncio.timeout(min(READ_TIMEOUT_S, timeout_s if timeout_s is not None else READ_TIMEOUT_S)):
                result = await (await self._bucket()).get(key)
        except BaseException:  # cut short (timed out, cancelled): nats.py unsubscribes only after the last chunk
            for subscription in subscriptions:
                with suppress(Exception):
                    await subscription.unsubscribe()
            raise
        finally:
            _read_subscriptions.reset(reading)
        return result.data or b""

    async def take(self, key: str, timeout_s: float | None = None) -> bytes:
        """Read a blob and delete it (a reply's: read once). One not read is left to the bucket's TTL."""
        data = await self.get(key, timeout_s)
        await self.delete(key)
        return data

    async def ack(self, msg: Msg, blob: str | None) -> None:
        """Ack a request and delete its body's blob: settled, however (answered, cancelled, refused, dead-lettered),
        it is read no more. A cancelled request's blob was left to the bucket's TTL: a client that sent 7 MB
        bodies and hung up at once grew nats-server's memory by 1.1 GB in 10 s, kept for 10 minutes."""
        await msg.ack()
        if blob:
            await self.delete(blob)

    async def delete(self, key: str) -> None:
        with suppress(Exception):  # already gone, or the TTL will take it
            await (await self._bucket()).delete(key)
