"""Operations routes: liveness, readiness, Prometheus metrics and the model list (OpenAPI: openapi.py)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from appliance.gateway.admin import model_record
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import json_response


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    reason = GatewayContext.of(request).not_ready_reason()
    if reason is not None:
        return json_response({"status": "not ready", "reason": reason}, status=503)
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    response = web.Response(body=generate_latest(ctx.metrics.registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response


async def list_models(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    data = [model_record(ctx, spec) for spec in ctx.catalog]
    return json_response({"object": "list", "data": data})


async def list_models_infinity(request: web.Request) -> web.Response:
    """`GET /models`, Infinity's path: the same list, each record without `owned_by`, which Infinity's client reads
    as an enum of its own server's one value ("infinity"), failing on any other; it reads a record without one."""
    ctx = GatewayContext.of(request)
    data = [model_record(ctx, spec) for spec in ctx.catalog]
    for record in data:
        del record["owned_by"]
    return json_response({"object": "list", "data": data})
