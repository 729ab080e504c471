"""What the routes may reach: settings, the catalog, the dispatcher, metrics and readiness."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from appliance.catalog import Catalog
from appliance.gateway.dispatch import Dispatcher
from appliance.metrics import Metrics
from appliance.settings import Settings


@dataclass(slots=True, frozen=True)
class GatewayContext:
    settings: Settings
    catalog: Catalog
    dispatcher: Dispatcher
    metrics: Metrics
    # Returns why the box is not ready, or None when it is.
    not_ready_reason: Callable[[], str | None]
    # Per model name: the boxes holding it and its bytes, for GET /v1/models.
    model_state: Callable[[str], dict]

    @staticmethod
    def of(request: web.Request) -> GatewayContext:
        return request.app[CONTEXT]


CONTEXT: web.AppKey[GatewayContext] = web.AppKey("fleetbox", GatewayContext)
