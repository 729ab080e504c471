"""Every NATS name fleetbox uses, and the idempotent set-up of streams and consumers.

Subjects, streams, consumers and buckets are built by the functions here and spelled nowhere
else. Set-up is create-if-missing: a second box starting against the same NATS never resets the
queue or a consumer's position.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import time
from contextlib import suppress
from dataclasses import replace
from datetime import datetime

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from appliance.envelope import BATCH, INTERACTIVE, PRIORITIES

log = logging.getLogger(__name__)

REQUEST_STREAM = "FBX_REQ"
DEAD_LETTER_STREAM = "FBX_DLQ"
DEAD_LETTER_MAX_BYTES = 256 * 1024 * 1024
_INSUFFICIENT_RESOURCES = {10028, 10047}  # JetStream's memory or file storage cannot reserve a stream's bounds
MODELS_BUCKET = "fbx_models"
NAMES_BUCKET = "fbx_names"
BOXES_BUCKET = "fbx_boxes"
BLOBS_BUCKET = "fbx_blobs"
# Two consumers per model (interactive, batch): room for 4,096 models. Said explicitly, since nats-server
# 2.15 otherwise limits a stream to 1,000 consumers (500 models).
MAX_REQUEST_CONSUMERS = 8192

_JUST_MADE_LOOKS = 20  # looks, a quarter of a second apart, for a stream another box has just made
_SLUG_UNSAFE = re.compile(r"[^a-z0-9_-]+")


def model_slug(name: str) -> str:
    """A model name as one NATS subject token and consumer name: lowercase, [a-z0-9_-]."""
    slug = _SLUG_UNSAFE.sub("-", name.lower()).strip("-")
    if not slug:
        raise ValueError(
            f"model name {name!r} has no character its queue's name can carry: a model's name needs at least one "
            "ASCII letter or digit (its slug, the NATS subject of its queue, is made of a-z, 0-9, '_' and '-')"
        )
    return slug


def name_key(name: str) -> str:
    """A model name or alias as its key in NAMES_BUCKET: its UTF-8 bytes in unpadded base64url, since a
    name may hold any printable character and keeps its case (the catalog compares names exactly)."""
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def request_subject(slug: str, priority: str = INTERACTIVE) -> str:
    """Interactive and batch work for a model wait on subjects (and consumers) of their own."""
    return f"fbx.bulk.{slug}" if priority == BATCH else f"fbx.req.{slug}"


def request_subjects() -> list[str]:
    return ["fbx.req.>", "fbx.bulk.>"]


def consumer_name(slug: str, priority: str = INTERACTIVE) -> str:
    return f"bulk_{slug}" if priority == BATCH else f"req_{slug}"


def slug_of_consumer(name: str) -> str | None:
    """The model slug of a request consumer's name (`consumer_name`'s inverse); None for any other consumer."""
    for prefix in ("req_", "bulk_"):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix) :]
    return None


def dead_letter_subject(slug: str) -> str:
    return f"fbx.dlq.{slug}"


def max_deliveries_advisories() -> str:
    """JetStream's notice that a request was delivered `max_deliver` times without an ack."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{REQUEST_STREAM}.*"


def cancel_subject() -> str:
    """Where a gateway says a request's client went away; every box listens."""
    return "fbx.cancel"


def request_blob_key(request_id: str, copy: int = 0) -> str:
    """A request body's object in BLOBS_BUCKET: put once, by the gateway that queued it; a copy it published again
    (`RequestMeta.copy`) has its own, since acking the first deletes the first's."""
    return f"{request_id}.copy{copy}" if copy else request_id


def reply_blob_key(request_id: str, box_id: str) -> str:
    """A reply body's object in BLOBS_BUCKET, one per box that answers: a redelivered request may be answered by
    two boxes, and the second's put must not overwrite (and purge the chunks of) the object the gateway reads."""
    return f"{request_id}.reply.{box_id}"


def reply_subject(box_id: str) -> str:
    """Where a gateway waits for its answers; the request carries it in `Fbx-Reply`."""
    return f"fbx.rep.{box_id}"


def reply_box(subject: str) -> str | None:
    """The box whose gateway waits on `subject` (`reply_subject`); None for any other subject."""
    prefix = reply_subject("")
    box_id = subject[len(prefix) :] if subject.startswith(prefix) else ""
    return box_id or None


def pull_inbox(box_id: str, slug: str, priority: str = INTERACTIVE) -> str:
    """Where one box's pull requests for one model (and priority) are answered."""
    return f"_FBX.pull.{box_id}.{slug}.{priority}"


def refuse_inbox(box_id: str, slug: str, priority: str = INTERACTIVE) -> str:
    """Where a box pulls requests it answers with an error: a model that failed to load on it, and nowhere else."""
    return f"{pull_inbox(box_id, slug, priority)}.refuse"


def pull_request_subject(slug: str, priority: str = INTERACTIVE) -> str:
    return f"$JS.API.CONSUMER.MSG.NEXT.{REQUEST_STREAM}.{consumer_name(slug, priority)}"


def control_subject(box_id: str, verb: str) -> str:
    return f"fbx.ctl.{box_id}.{verb}"


async def replay(
    js: JetStreamContext, bucket: str, watcher: KeyValue.KeyWatcher, *, timeout_s: float = 10.0
) -> list[KeyValue.Entry]:
    """What a fresh `watchall` replays of a bucket: every current entry, read up to the bucket's last message.

    nats-py's marker for the replay's end (a None) can come before the replay has ended (nats.py #842, #995):
    taken at its word, `fleetbox models list` printed an empty catalog about 1 run in 20 (operator tester h60).
    Past `timeout_s`, what was read is returned, as the marker's word was before."""
    stream = f"KV_{bucket}"
    state = (await js.stream_info(stream)).state
    entries: list[KeyValue.Entry] = []
    try:
        async with asyncio.timeout(timeout_s):
            async for entry in watcher:
                if entry is None:
                    if not state.messages or not await _holds(js, stream, state.last_seq):
                        break  # nothing to replay, or its last message compacted away: the marker is the end
                    continue
                entries.append(entry)
                if entry.revision is not None and entry.revision >= state.last_seq:
                    break
    except TimeoutError:
        log.warning("bucket not replayed to its end", extra={"bucket": bucket, "entries": len(entries)})
    return entries


async def stop_watch(
    js: JetStreamContext, watcher: KeyValue.KeyWatcher, *, connected: bool = True, timeout_s: float = 2.0
) -> None:
    """Stop a bucket's watch and delete its consumer. nats-py's `stop` only unsubscribes, and the server keeps the
    ephemeral consumer for its inactive threshold (5 minutes): each stopped box, and each reopen of its watches after
    a NATS restart, left two on the buckets' streams. The consumer's name is the subscription's (an ordered consumer
    takes a new one at each reset). Cut off from NATS (`connected` false) it is left to the threshold: the delete
    would wait out its bound for nothing."""
    sub = getattr(watcher, "_sub", None)  # nats-py keeps the subscription there; its public API names no consumer
    stream, consumer = getattr(sub, "_stream", None), getattr(sub, "_consumer", None)
    with suppress(Exception):  # its consumer may be gone with the server that held it
        await watcher.stop()
    if connected and stream and consumer:
        with suppress(NatsError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await js.delete_consumer(stream, consumer)


async def _holds(js: JetStreamContext, stream: str, seq: int) -> bool:
    """Whether the stream still holds its message `seq` (`nats kv compact` removes a deletion's marker, and the
    stream's last sequence then names a message no replay delivers: review r61)."""
    try:
        await js.get_msg(stream, seq)
    except NotFoundError:
        return False
    return True


async def ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """A KV bucket, created as `config` says if it is missing; an existing one is left exactly as it is."""
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        return await js.create_key_value(config)


async def ensure_request_stream(
    js: JetStreamContext,
    *,
    max_msgs: int,
    max_bytes: int,
    max_age_s: float,
    file_storage: bool = False,
    replicas: int = 1,
) -> datetime | None:
    """Create FBX_REQ if it is missing; an existing stream is left as it is, but for its consumer limit when
    the server's default holds it (see `_raise_consumer_limit`). Returns when the stream was made: a box that
    sees it change knows the requests it published before are gone with the old one."""
    try:
        info = await js.stream_info(REQUEST_STREAM)
    except NotFoundError:
        pass
    else:
        await _raise_consumer_limit(js, info.config)
        _say_kept(info.config, file_storage=file_storage, replicas=replicas)
        return info.created
    config = StreamConfig(
        name=REQUEST_STREAM,
        subjects=request_subjects(),
        retention=RetentionPolicy.WORK_QUEUE,
        discard=DiscardPolicy.NEW,
        max_msgs=max_msgs,
        max_bytes=max_bytes,
        max_age=max_age_s,
        storage=StorageType.FILE if file_storage else StorageType.MEMORY,
        num_replicas=replicas,
        duplicate_window=120.0,
        max_consumers=MAX_REQUEST_CONSUMERS,
        # Numbered from the time it is made (in microseconds), not from 1: a stream made anew after a nats-server
        # restart without --durable starts above every number the old one reached, so an ack, nak or in-progress
        # ack a box sends for a message of the old stream finds nothing; numbered from 1, nats-server took it for
        # the new stream's message of the same numbers (review r43).
        first_seq=time.time_ns() // 1000,
    )
    try:
        created = await js.add_stream(config)
        log.info("stream created", extra={"stream": REQUEST_STREAM})
        return created.created
    except BadRequestError as exc:
        # Another box created it between our look and our create: that is the same stream.
        if exc.err_code != 10058:  # stream name already in use
            raise
    # Made by another box a moment ago: on a fresh cluster its info may be "not found" for a moment after the
    # create said it exists (3 boxes started with a 3-server cluster, 1 run of 4 on a loaded machine).
    for _ in range(_JUST_MADE_LOOKS):
        try:
            return (await js.stream_info(REQUEST_STREAM)).created
        except NotFoundError:
            await asyncio.sleep(0.25)
    return (await js.stream_info(REQUEST_STREAM)).created


def _say_kept(config: StreamConfig, *, file_storage: bool, replicas: int) -> None:
    """An existing request stream keeps its storage and replicas whatever this box's settings: say so where they
    differ (a state dir switched from --durable, or --replicas raised on a running fleet, was silent: tester h73)."""
    wanted = {"storage": "file" if file_storage else "memory", "replicas": replicas}
    kept = {"storage": _storage_name(config.storage), "replicas": config.num_replicas or 1}
    if kept != wanted:
        log.warning(
            "the request stream keeps the storage and replicas it was made with, not this box's settings"
            " (configuration.md: delete the stream to apply them)",
            extra={"stream": REQUEST_STREAM, "kept": kept, "settings": wanted},
        )


def _storage_name(storage: StorageType | str | None) -> str:
    value = storage.value if isinstance(storage, StorageType) else storage
    return value or "file"  # JetStream's default


async def _raise_consumer_limit(js: JetStreamContext, config: StreamConfig) -> None:
    """A stream an older fleetbox made has no consumer limit of its own, so nats-server's default (1,000 from
    2.15 on: 500 models) holds it; raise it to what a new stream gets. A limit an operator set is theirs to
    keep. A server that refuses the update (a user without the permission, say) leaves the old limit, logged."""
    if config.max_consumers not in (None, -1):
        return
    try:
        await js.update_stream(replace(config, max_consumers=MAX_REQUEST_CONSUMERS))
    except NatsError as exc:  # a refusal, or no answer at all (a user denied the update subject gets none)
        error = exc.description if isinstance(exc, APIError) else None
        log.warning(
            "could not raise the request stream's consumer limit",
            extra={"stream": REQUEST_STREAM, "error": error or repr(exc)},
        )
        return
    log.info("stream's consumer limit raised", extra={"stream": REQUEST_STREAM, "max_consumers": MAX_REQUEST_CONSUMERS})


async def ensure_request_consumers(
    js: JetStreamContext, slug: str, *, ack_wait_s: float, max_deliver: int, max_ack_pending: int
) -> None:
    """Create the shared durable pull consumers (interactive and batch) of one model if missing."""
    for priority in PRIORITIES:
        await _ensure_consumer(
            js, slug, priority, ack_wait_s=ack_wait_s, max_deliver=max_deliver, max_ack_pending=max_ack_pending
        )


async def delete_request_consumers(js: JetStreamContext, slug: str) -> None:
    """Remove a deleted model's two consumers (one already gone is fine): left behind, every model ever
    registered would keep two, and nats-server (2.15 on) refuses a stream's 1001st consumer."""
    for priority in PRIORITIES:
        try:
            await js.delete_consumer(REQUEST_STREAM, consumer_name(slug, priority))
        except NotFoundError:
            pass


async def next_request_sequence(js: JetStreamContext) -> int:
    """The sequence the request stream gives its next message: every message below it was sent before now."""
    return int((await js.stream_info(REQUEST_STREAM)).state.last_seq) + 1


async def purge_requests(js: JetStreamContext, slug: str, *, sent_before: int) -> None:
    """Drop a deleted model's requests still in the stream (both priorities), those sent before `sent_before`
    only: its consumers are gone, and a work queue keeps a message nobody acked until its max age, where a
    registration of the same slug would take it up. What was sent after is a new registration's."""
    for priority in PRIORITIES:
        await js.purge_stream(REQUEST_STREAM, seq=sent_before, subject=request_subject(slug, priority))


async def _ensure_consumer(
    js: JetStreamContext, slug: str, priority: str, *, ack_wait_s: float, max_deliver: int, max_ack_pending: int
) -> None:
    name = consumer_name(slug, priority)
    try:
        await js.consumer_info(REQUEST_STREAM, name)
        return
    except NotFoundError:
        pass
    config = ConsumerConfig(
        durable_name=name,
        filter_subject=request_subject(slug, priority),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        max_waiting=512,
    )
    try:
        await js.add_consumer(REQUEST_STREAM, config)
    except BadRequestError as exc:
        if exc.err_code != 10148:  # consumer already exists (created concurrently)
            raise


async def ensure_dead_letter_stream(js: JetStreamContext, *, file_storage: bool = False, replicas: int = 1) -> None:
    """FBX_DLQ keeps requests that failed on every delivery, with the reason, for an operator to inspect."""
    try:
        await js.stream_info(DEAD_LETTER_STREAM)
        return
    except NotFoundError:
        pass
    config = StreamConfig(
        name=DEAD_LETTER_STREAM,
        subjects=["fbx.dlq.>"],
        retention=RetentionPolicy.LIMITS,
        max_msgs=10_000,
        # Each keeps its request's body: unbounded, 10,000 poison requests of a megabyte held 10 GB of the server's
        # memory for a week (tester h185). Past it the oldest go (discard old).
        max_bytes=DEAD_LETTER_MAX_BYTES,
        max_age=7 * 24 * 3600.0,
        storage=StorageType.FILE if file_storage else StorageType.MEMORY,
        num_replicas=replicas,
    )
    try:
        try:
            await js.add_stream(config)
        except APIError as exc:
            if exc.err_code not in _INSUFFICIENT_RESOURCES:
                raise
            # nats-server reserves a stream's max_bytes at its creation: where JetStream's own limit leaves no room
            # for it beside the request stream's, made unbounded in bytes, as before (review h186), not a box that
            # cannot start.
            log.warning(
                "dead-letter stream made without its byte bound",
                extra={"stream": DEAD_LETTER_STREAM, "max_bytes": DEAD_LETTER_MAX_BYTES, "error": repr(exc)},
            )
            await js.add_stream(replace(config, max_bytes=-1))
    except BadRequestError as exc:
        if exc.err_code != 10058:
            raise
