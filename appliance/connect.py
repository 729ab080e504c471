"""Joining NATS and making what a box needs there: TLS, the request queue and a model's consumers.

The client TLS and the `NatsAuth` value are shared with the TUI and the CLI, which join the same way.

Every step is idempotent (create if missing, never reset), so any box may run it at any time: at
start, or after a reconnect to a server that lost what it kept in memory. A fresh NATS cluster may
still be electing its leaders when the first boxes start: `when_jetstream_answers` waits that out.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from appliance import bus
from appliance.catalog import Catalog, ModelSpec
from appliance.catalog_store import CatalogStore
from appliance.errors import Conflict, NotFound
from appliance.fleet import Fleet
from appliance.settings import Settings

log = logging.getLogger(__name__)

_SETTLE_LOOKS = 3  # a catalog still changing under a model's queue after this many: the next change settles it
_SETTLE_TRIES = 3  # a deleted model's consumers not removed (JetStream not answering): tries, a second apart

_JETSTREAM_SETTLE_S = 60.0  # how long a starting box waits for a NATS cluster's JetStream to answer
_RESTORE_ATTEMPTS = 30  # after a reconnect, seconds (about) to keep trying to restore streams and buckets
# A request consumer of no catalogued model is a deleted model's leftover once this old: younger, it may be a
# registration's on another box whose catalog entry is being written.
_LEFTOVER_AGE_S = 60.0
_CONSUMERS_PAGE = 256  # what one consumer listing of JetStream's API holds


@dataclass(slots=True, frozen=True)
class NatsAuth:
    """How a client proves itself to NATS: a credentials file (user JWT and nkey seed) and client TLS,
    either or both absent (a `tls://` URL without a context then trusts the system's CAs)."""

    creds: Path | None = None
    tls: ssl.SSLContext | None = None


NO_AUTH = NatsAuth()  # a local NATS that asks for nothing


class BadTlsFiles(ValueError):
    """A TLS file that cannot be used; the message is one line naming the option and the file."""


def client_tls(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The client TLS of `--tls-ca/--tls-cert/--tls-key`, or None when neither a CA nor a certificate is given.

    Raises `BadTlsFiles` for a file that is missing, unreadable or not what its option says: the
    ssl module alone names none of them ("PEM lib"), and would prompt on the terminal for an
    encrypted key's passphrase. Without `key` the key is read from the certificate's file.
    """
    if key is not None and cert is None:
        raise BadTlsFiles(f"tls-key: {key} is given without its certificate (--tls-cert)")
    if ca is None and cert is None:
        return None
    if ca is not None:
        _pem("tls-ca", ca, "CERTIFICATE")
    try:
        context = ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise BadTlsFiles(f"tls-ca: {ca} holds a broken certificate ({exc.reason or exc})") from None
    if cert is not None:
        _pem("tls-cert", cert, "CERTIFICATE")
        _pem("tls-key", key or cert, "PRIVATE KEY")
        try:
            context.load_cert_chain(cert, key, password=_refuse_passphrase(key or cert))
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise BadTlsFiles(f"tls-key: {key or cert} is not the key of the certificate {cert}") from None
            raise BadTlsFiles(f"tls-cert: {cert} with key {key or cert}: {exc.reason or exc}") from None
    return context


class NatsInTheClear(Exception):
    """A NATS server answered without TLS where TLS was asked for; the message says which and how to fix it."""

    reason = (
        "the server does not speak TLS, though TLS is asked for (--tls-ca, --tls-cert or a tls:// URL):"
        " refusing to talk to it in the clear; give the server a tls block, or drop the TLS options"
    )

    def __init__(self, server: str) -> None:
        super().__init__(f"NATS at {server}: {self.reason}")


def shown_url(url: str) -> str:
    """A NATS URL (or a comma-separated list of them) without user and password, for messages and logs."""
    return ",".join(re.sub(r"^([a-z]+://)?[^@/]*@", r"\1", part.strip()) for part in url.split(","))


async def refuse_plain_servers(urls: list[str], tls: ssl.SSLContext | None, timeout_s: float = 5.0) -> None:
    """With TLS asked for, read each server's INFO before nats-py connects, and raise `NatsInTheClear` for one that
    does not require TLS: nats-py would send it the CONNECT (a user and password of the URL, say) in the clear
    before `in_the_clear` could refuse it (tester h74). A server that cannot be read now is left to nats-py (and
    to `in_the_clear` after the connect); so is a websocket URL."""
    if not asks_for_tls(urls, tls):
        return
    for url in urls:
        parsed = urlparse(url.strip() if "://" in url else f"nats://{url.strip()}")
        if parsed.scheme not in ("nats", "tls") or not parsed.hostname:
            continue
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port or 4222)
                try:
                    line = await reader.readline()  # a server that wants the TLS handshake first says nothing
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            continue
        if line.startswith(b"INFO "):
            try:
                info = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if not info.get("tls_required"):
                raise NatsInTheClear(shown_url(url))


def asks_for_tls(urls: list[str], tls: ssl.SSLContext | None) -> bool:
    """Whether the operator asked for TLS: a client TLS context, or a `tls://` URL."""
    return tls is not None or any(url.strip().lower().startswith("tls://") for url in urls)


def in_the_clear(nc: Any) -> bool:
    """Whether `nc` is connected over plain TCP.

    nats-py starts TLS only when the server's INFO asks for it: given a CA, a client certificate or
    a `tls://` URL, it still talks in the clear to a server without TLS, where the Go client refuses
    ("secure connection not available"). nats-py has no public word of it: its TCP transport's
    writer does (a websocket transport has none, and is not judged here)."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    return writer is not None and writer.get_extra_info("ssl_object") is None


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """A box's client TLS, from its settings (see `client_tls`)."""
    return client_tls(settings.tls_ca, settings.tls_cert, settings.tls_key)


def _pem(option: str, path: Path, kind: str) -> None:
    """Refuse a file that is missing, unreadable or holds no PEM `kind` block (`CERTIFICATE`, `PRIVATE KEY`)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")  # a CA bundle's comments may be in any script
    except FileNotFoundError:
        raise BadTlsFiles(f"{option}: {path} does not exist") from None
    except OSError as exc:
        raise BadTlsFiles(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    if not re.search(rf"-----BEGIN [A-Z ]*{kind}-----", text):
        raise BadTlsFiles(f"{option}: {path} holds no PEM {kind.lower()}")


def _refuse_passphrase(key: Path) -> Callable[[], str]:
    def refuse() -> str:
        raise BadTlsFiles(f"tls-key: {key} is encrypted; give it without a passphrase")

    return refuse


async def ensure_queue(js: JetStreamContext, settings: Settings) -> datetime | None:
    """The request stream and the dead-letter stream, as the settings size and store them; when the request stream
    was made (`bus.ensure_request_stream`)."""
    created = await bus.ensure_request_stream(
        js,
        max_msgs=settings.stream_max_msgs,
        max_bytes=settings.stream_max_bytes,
        max_age_s=settings.stream_max_age_s,
        file_storage=settings.durable,
        replicas=settings.replicas,
    )
    await bus.ensure_dead_letter_stream(js, file_storage=settings.durable, replicas=settings.replicas)
    return created


async def ensure_consumers(js: JetStreamContext, settings: Settings, slug: str) -> None:
    """A model's two shared pull consumers (interactive and batch)."""
    await bus.ensure_request_consumers(
        js,
        slug,
        ack_wait_s=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=settings.max_ack_pending,
    )


async def open_model_queue(js: JetStreamContext, settings: Settings, slug: str) -> None:
    """A model's two consumers, both or neither: one the server refused (its consumer limit, say) leaves
    the other removed, and the refusal raised."""
    try:
        await ensure_consumers(js, settings, slug)
    except NatsError:
        await bus.delete_request_consumers(js, slug)
        raise


async def open_catalogued_queues(
    js: JetStreamContext,
    settings: Settings,
    catalog: Catalog,
    attempt: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]] | None = None,
) -> None:
    """Every catalogued model's two consumers (an adapter runs on its base's), each step run through `attempt`
    (`when_jetstream_answers` at start). A queue the server refuses for good (its consumer limit, say) is
    logged and the rest are made: one model's queue is not worth a box that fails to start or to restore. JetStream
    not answering yet (no leader) is raised, for the caller's retry."""
    for spec in list(catalog):
        if spec.adapter_of is not None:
            continue
        step = partial(ensure_consumers, js, settings, spec.slug)
        try:
            await (attempt(step) if attempt is not None else step())
        except APIError as exc:
            if _jetstream_not_ready(exc):  # not a refusal: JetStream cannot answer yet, so the whole step is retried
                raise
            log.error("model's queue not made", extra={"model": spec.name, "error": exc.description or repr(exc)})


async def remove_leftover_queues(js: JetStreamContext, catalog: Catalog) -> list[str]:
    """Remove the request consumers of models the catalog's bucket no longer holds, made over a minute ago: a
    deletion whose consumer removal JetStream refused (its consumer limit reached, a leader lost) left them for
    good, each counting toward the stream's limit (tester h94). Run as a box starts; returns those removed."""
    held = {spec.slug for spec in catalog if spec.adapter_of is None}  # once: a lookup per consumer scanned them all
    now, offset, leftovers = datetime.now(UTC), 0, []
    while True:
        page = await js.consumers_info(bus.REQUEST_STREAM, offset=offset)
        for info in page:
            slug = bus.slug_of_consumer(info.name)
            if slug is None or slug in held:
                continue  # a model's, or not fleetbox's (an operator's own consumer)
            if info.created is None or (now - info.created).total_seconds() >= _LEFTOVER_AGE_S:
                leftovers.append((slug, info.name))
        if len(page) < _CONSUMERS_PAGE:
            break
        offset += len(page)
    if not leftovers:
        return []
    models = await js.key_value(bus.MODELS_BUCKET)
    removed = []
    for slug, name in leftovers:
        try:  # the bucket's word, not this box's catalog alone: a model registered a moment ago keeps its queue
            entry = await models.get(slug)
            if entry.value and ModelSpec.from_json(entry.value).adapter_of is None:
                continue
        except KeyNotFoundError:
            pass
        with suppress(NotFoundError):  # removed by another box starting meanwhile
            await js.delete_consumer(bus.REQUEST_STREAM, name)
        removed.append(name)
    if removed:
        log.info("leftover queues of deleted models removed", extra={"consumers": removed})
    return removed


async def restore_after_reconnect(
    js: JetStreamContext, settings: Settings, catalog: Catalog, store: CatalogStore | None, fleet: Fleet | None
) -> datetime | None:
    """A NATS server that restarted kept only what it stores in files: make again what it lost (the
    heartbeats bucket always; without --durable the queue, its consumers and the catalog too).
    Retried for a while, as a cluster may still be electing stream leaders. Returns when the request stream
    was made (None if it could not be restored)."""
    for _ in range(_RESTORE_ATTEMPTS):
        try:
            created = await ensure_queue(js, settings)
            if store is not None:
                await store.reopen()
            await open_catalogued_queues(js, settings, catalog)
            if fleet is not None:
                await fleet.reopen()
            return created
        except Conflict:
            raise  # another live box beats under this box's id now: no retry makes it this box's again
        except Exception as exc:
            log.warning("restoring streams failed; retrying", extra={"error": repr(exc)})
            await asyncio.sleep(1.0)
    return None


async def settle_model_queue(js: JetStreamContext, settings: Settings, catalog: Catalog, slug: str) -> None:
    """Make a model's two consumers match the catalog: both while it holds the model, neither once it does
    not. Looked at again after acting, since a registration or a deletion of the same slug (on any box) may
    have changed the catalog meanwhile: a deletion must not take the consumers a re-registration just made,
    nor a registration that failed leave one behind; the last look decides."""
    for _ in range(_SETTLE_LOOKS):
        spec = catalog.by_slug(slug)
        wanted = spec is not None and spec.adapter_of is None
        if wanted:
            await open_model_queue(js, settings, slug)
        else:
            await bus.delete_request_consumers(js, slug)
        spec = catalog.by_slug(slug)
        if wanted == (spec is not None and spec.adapter_of is None):
            return


async def delete_model(
    js: JetStreamContext, settings: Settings, catalog: Catalog, store: CatalogStore, spec: ModelSpec
) -> list[str]:
    """Take a model out of the fleet: out of the catalog (every gateway then answers what it awaits for it 404),
    its consumers removed, and what waits in its queue dropped, up to the moment of the deletion, so nothing of
    it sits in the stream or is taken up by a model registered under its slug next. Returns the adapters deleted
    with it: registered on another box while the deletion was judged."""
    try:
        sent_before: int | None = await bus.next_request_sequence(js)
    except NatsError as exc:
        log.warning("request stream not read before a deletion", extra={"model": spec.name, "error": repr(exc)})
        sent_before = None
    if not await store.delete(spec):
        raise NotFound(f"model {spec.name} was deleted a moment ago, by another request", code="model_not_found")
    if spec.adapter_of is not None:
        return []  # an adapter runs on its base's queue
    # An adapter registered on another box while this deletion was judged (the route refuses a base with the
    # adapters it knows of) would be left without a base, and inherited by a model registered under the name next.
    # Said in the answer: its registration was answered 201 (tester h80).
    adapters = await store.adapters_in_bucket(spec.name)
    for adapter in adapters:
        await store.delete(adapter)
    names = [adapter.name for adapter in adapters]
    if names:
        log.warning("adapters deleted with their base", extra={"model": spec.name, "adapters": names})
    await _settle_deleted_queue(js, settings, catalog, spec)
    if sent_before is not None:  # bounded: what a registration of the slug made since is sent is kept
        try:
            await bus.purge_requests(js, spec.slug, sent_before=sent_before)
        except NatsError as exc:  # they expire with the stream's max age
            log.warning("deleted model's requests not purged", extra={"model": spec.name, "error": repr(exc)})
    return names


async def _settle_deleted_queue(js: JetStreamContext, settings: Settings, catalog: Catalog, spec: ModelSpec) -> None:
    """A deleted model's consumers removed, tried again while JetStream does not answer: the deletion is made (the
    catalog's entry is gone), and a consumer of a replicated stream made a moment before may not answer its delete
    yet (tester h87, a 3-server cluster: a DELETE right after the registration answered 500 after 5 s, 4 of 6). Left
    behind, a leftover is logged; a registration of the slug takes it up again."""
    for attempt in range(_SETTLE_TRIES):
        try:
            await settle_model_queue(js, settings, catalog, spec.slug)
            return
        except NatsError as exc:
            if attempt + 1 == _SETTLE_TRIES:
                log.warning("deleted model's consumers not removed", extra={"model": spec.name, "error": repr(exc)})
                return
            await asyncio.sleep(1.0)


async def when_jetstream_answers(step: Callable[[], Awaitable[Any]]) -> None:
    """Run an idempotent set-up step, again while JetStream cannot answer yet: boxes started with a
    fresh NATS cluster meet it still electing its meta leader, or the leader of a stream another
    box has just created. Bounded; any other error fails the start at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _JETSTREAM_SETTLE_S
    while True:
        try:
            await step()
            return
        except Exception as exc:
            if not _jetstream_not_ready(exc) or loop.time() >= deadline:
                raise
            # Its words as well as its type: "BadRequestError()" hid "no suitable peers for placement" for 60 s (h87).
            log.warning("JetStream is not ready yet; retrying", extra={"error": f"{exc!r}: {exc}"})
            await asyncio.sleep(1.0)


def _jetstream_not_ready(exc: Exception) -> bool:
    """No answer, no responders, or JetStream's own "not available yet" (no leader, too few peers)."""
    if isinstance(exc, NatsTimeout | NoRespondersError | NoStreamResponseError | ServiceUnavailableError):
        return True
    return isinstance(exc, APIError) and exc.err_code in (10005, 10008, 10023)  # no peers, unavailable, resources
