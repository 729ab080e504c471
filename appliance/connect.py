"""Joining NATS and making what a box needs there: TLS, the request queue and a model's consumers.

Every step is idempotent (create if missing, never reset), so any box may run it at any time: at
start, or after a reconnect to a server that lost what it kept in memory. A fresh NATS cluster may
still be electing its leaders when the first boxes start: `when_jetstream_answers` waits that out.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from appliance import bus
from appliance.settings import Settings

log = logging.getLogger(__name__)

_JETSTREAM_SETTLE_S = 60.0  # how long a starting box waits for a NATS cluster's JetStream to answer


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The client TLS of `--tls-ca/--tls-cert/--tls-key`, or None (a `tls://` URL then uses the system's CAs)."""
    if not (settings.tls_ca or settings.tls_cert):
        return None
    context = ssl.create_default_context(cafile=str(settings.tls_ca) if settings.tls_ca else None)
    if settings.tls_cert:
        context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key or settings.tls_cert))
    return context


async def ensure_queue(js: JetStreamContext, settings: Settings) -> None:
    """The request stream and the dead-letter stream, as the settings size and store them."""
    await bus.ensure_request_stream(
        js,
        max_msgs=settings.stream_max_msgs,
        max_bytes=settings.stream_max_bytes,
        max_age_s=settings.stream_max_age_s,
        file_storage=settings.durable,
        replicas=settings.replicas,
    )
    await bus.ensure_dead_letter_stream(js, file_storage=settings.durable, replicas=settings.replicas)


async def ensure_consumers(js: JetStreamContext, settings: Settings, slug: str) -> None:
    """A model's two shared pull consumers (interactive and batch)."""
    await bus.ensure_request_consumers(
        js,
        slug,
        ack_wait_s=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=settings.max_ack_pending,
    )


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
            log.warning("JetStream is not ready yet; retrying", extra={"error": repr(exc)})
            await asyncio.sleep(1.0)


def _jetstream_not_ready(exc: Exception) -> bool:
    """No answer, no responders, or JetStream's own "not available yet" (no leader, too few peers)."""
    if isinstance(exc, NatsTimeout | NoRespondersError | NoStreamResponseError | ServiceUnavailableError):
        return True
    return isinstance(exc, APIError) and exc.err_code in (10005, 10008, 10023)  # no peers, unavailable, resources
