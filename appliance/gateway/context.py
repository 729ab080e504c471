"""What the routes may reach: settings, the catalog, the dispatcher, metrics and the box's state."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from nats.aio.client import Client as NATS
from nats.nuid import NUID

from appliance.catalog import Catalog, ModelSpec
from appliance.catalog_store import CatalogStore
from appliance.errors import ServiceUnavailable
from appliance.gateway.dispatch import Dispatcher
from appliance.metrics import Metrics
from appliance.pin_fits import PinJudge
from appliance.settings import Settings

NO_WORKER_GRACE_S = 10.0  # past a heartbeat's TTL: how long a gateway queues requests for a worker to come back


@dataclass(slots=True, frozen=True)
class GatewayContext:
    settings: Settings
    catalog: Catalog
    store: CatalogStore
    dispatcher: Dispatcher | None  # None on a worker-only box, which serves no API
    metrics: Metrics
    nc: NATS
    box_id: str
    # Returns why the box is not ready, or None when it is.
    not_ready_reason: Callable[[], str | None]
    # Whether the box is stopping (it takes no new requests).
    is_draining: Callable[[], bool]
    # Per model name: state, the boxes holding it and its bytes, for GET /v1/models.
    model_state: Callable[..., dict[str, Any]]  # (name, spec=None, *, draining=False): box_status.model_state
    # Heartbeat records of the live boxes.
    live_boxes: Callable[[], list[dict[str, Any]]]
    # Seconds since a live box taking model work was last heard of (`Fleet.without_workers_s`).
    without_workers_s: Callable[[], float]
    # A judge of one pin or registration: a model pinned now must fit beside the models pinned on some box that
    # runs models, or it is never loaded and each of its requests gets a 503 (`verbs.pin_judge`, `pin_fits.py`).
    pin_judge: Callable[[], PinJudge]
    # A registered model's queue consumers made (raises the server's refusal).
    open_queue: Callable[[ModelSpec], Awaitable[None]]
    # A model out of the catalog, its consumers removed and its queued requests dropped.
    delete_model: Callable[[ModelSpec], Awaitable[list[str]]]
    ids: NUID = field(default_factory=NUID)  # request ids: unique across gateways (random prefix per NUID)

    @staticmethod
    def of(request: web.Request) -> GatewayContext:
        return request.app[CONTEXT]

    def refuse_without_workers(self) -> None:
        """503 at once when no box in the fleet has run models for a while: queued, the request waited out its deadline
        (a 504 after 30 s) while `/v1/models` already showed no box to run it (operator tester h60). Through a
        worker's restart (its heartbeat gone less than `NO_WORKER_GRACE_S` ago) requests are queued, for the worker
        that comes back; a box that runs models itself never refuses."""
        if self.settings.runs_models:
            return
        gone_s = self.without_workers_s()
        if gone_s <= self.settings.heartbeat_ttl_s + NO_WORKER_GRACE_S:
            return
        raise ServiceUnavailable(
            f"no box in the fleet runs models (none for {gone_s:.0f} s); start one with --role worker or all",
            retry_after_s=2,
        )

    def new_request_id(self) -> str:
        """The id a request carries through the queue, the logs and the `Fbx-Request-Id` header."""
        return self.ids.next().decode()


CONTEXT: web.AppKey[GatewayContext] = web.AppKey("fleetbox", GatewayContext)
REQUEST_ID: web.RequestKey[str] = web.RequestKey("fbx_request_id", str)  # the request id the middleware set
CLIENT_REQUEST_ID: web.RequestKey[str] = web.RequestKey("fbx_client_request_id", str)  # the client's, if it sent one
CLIENT_GONE: web.RequestKey[bool] = web.RequestKey("fbx_client_gone", bool)  # it hung up mid-stream: a 499


# A client's own `X-Request-Id` that is echoed: visible ASCII, no spaces, at most 200 characters (a header value that
# is not one is ignored, as a missing one: it would be a log injection or a header too large to echo).
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,200}")


def client_request_id(request: web.Request) -> str | None:
    """The `X-Request-Id` the client sent, to be echoed in its answer (as vLLM and proxies such as nginx do, so the
    client's tracing ties the answer to its call), or None. The box's own id stays the request's id on the queue and
    in `Fbx-Request-Id`: a client's id need not be unique, and two requests under one id would share a reply."""
    sent = request.headers.get("X-Request-Id")
    return sent if sent is not None and _CLIENT_ID.fullmatch(sent) else None


def request_id_headers(request: web.Request) -> dict[str, str]:
    """The answer's id headers: the box's id, and in `X-Request-Id` (read by the openai SDK) the client's own id if it
    sent one, else the box's."""
    request_id = request[REQUEST_ID]
    return {"Fbx-Request-Id": request_id, "X-Request-Id": request.get(CLIENT_REQUEST_ID) or request_id}
