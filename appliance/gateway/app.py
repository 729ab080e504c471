"""The aiohttp application: routes, and the one middleware that turns every failure into the error shape.

A draining box answers its probes and metrics only: anything else is a 503 at once, and every answer
closes its connection, so clients holding keep-alive connections move to another box.

No route returns a 500 for anything a client can send: typed errors carry their status; aiohttp's
own HTTP errors (unknown route, wrong method, too large) are reshaped; anything else is logged
with its request id and answered 500, the only path to one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import HttpVersion11, hdrs, web
from nats.errors import Error as NatsError

from appliance.catalog import ModelSpec
from appliance.errors import (
    ExpectationFailed,
    FleetboxError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    model_deleted,
)
from appliance.gateway import admin, cors, encoders, generation, openapi, ops, tei, tei_info, tei_models
from appliance.gateway.auth import IN_FLIGHT, Handler, inference, may_send_body, metrics_guard
from appliance.gateway.auth import admin as admin_only
from appliance.gateway.context import (
    CLIENT_GONE,
    CLIENT_REQUEST_ID,
    CONTEXT,
    REQUEST_ID,
    GatewayContext,
    client_request_id,
    request_id_headers,
)
from appliance.gateway.dispatch import Dispatcher
from appliance.gateway.http import RECEIVING, Receiving, json_response
from appliance.gateway.publish import FAILOVER_RETRY_S
from appliance.registration import MODEL_VERBS

log = logging.getLogger(__name__)


def _count(request: web.Request, status: int, started: float) -> None:
    """Count the request under its route and status, and log it in one line: failures at INFO (5xx at WARNING, but
    a 503, a refusal to retry as a 429 is: a NATS outage of 2.5 s under load made 4,331 WARNING lines, h190; the
    outage itself is said at WARNING once a minute), successes at DEBUG to keep the hot path cheap."""
    ctx = GatewayContext.of(request)
    route = _route_label(request)
    elapsed_ms = (time.perf_counter() - started) * 1000
    ctx.metrics.requests.labels(route, str(status)).inc()
    ctx.metrics.request_ms.labels(route).observe(elapsed_ms)
    level = logging.WARNING if status >= 500 and status != 503 else logging.INFO if status >= 400 else logging.DEBUG
    if log.isEnabledFor(level):
        extra = {"request_id": request[REQUEST_ID], "method": request.method, "route": route, "status": status}
        if (client_id := request.get(CLIENT_REQUEST_ID)) is not None:
            extra["client_request_id"] = client_id
        log.log(level, "request", extra=extra | {"ms": round(elapsed_ms, 2)})


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


CLIENT_CLOSED_REQUEST = 499  # nginx's word, in the metrics and the log, for a client that hung up mid-stream

# Answered while a box drains: the probes and the metrics.
_OPERATIONS = frozenset({"/healthz", "/readyz", "/health", "/metrics"})


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    ctx = GatewayContext.of(request)
    started = time.perf_counter()
    request[REQUEST_ID] = ctx.new_request_id()
    if (client_id := client_request_id(request)) is not None:
        request[CLIENT_REQUEST_ID] = client_id
    try:
        if (expect := request.get(_UNKNOWN_EXPECT)) is not None:  # in the error shape, logged and counted
            raise ExpectationFailed(f"unknown Expect: {expect[:100]!r}; only 100-continue is understood")
        if ctx.is_draining() and request.path not in _OPERATIONS:
            # A stopping box takes no new work, even on a connection kept alive from before: the client's retry
            # goes to another box at once, and the box stops as soon as what it took is answered.
            raise ServiceUnavailable(f"box {ctx.box_id} is stopping; send the request to another box", retry_after_s=1)
        response = await handler(request)
    except FleetboxError as exc:
        # A model path's trailing `/` reads as part of the name (`{name:.+}` takes slashes): a model not found there
        # is the route without it, as for any other route (tester h181: "model 'enc/embed/' does not exist").
        if exc.code == "model_not_found" and (route := await _route_without_slash(request)) is not None:
            response = _redirect(request, route)
        else:
            response = _error_response(exc)
    except web.HTTPException as exc:
        if exc.status in (404, 405) and (route := await _route_without_slash(request)) is not None:
            response = _redirect(request, route)
        else:
            response = _error_response(_from_http_exception(exc, serves_api=ctx.settings.serves_http))
    except asyncio.CancelledError:  # its client hung up (`handler_cancellation`): counted, as nginx does, 499
        _count(request, CLIENT_CLOSED_REQUEST, started)
        raise
    except NatsError as exc:
        # NATS or JetStream did not answer a step outside the request path's own handling (the catalog's, an admin
        # route's) in a failover or a quorum lost: a 503 to retry, not a 500 (tester h87: a registration then).
        log.warning("NATS did not answer", extra={"path": request.path, "error": f"{exc!r}: {exc}"})
        response = _error_response(
            ServiceUnavailable(
                "NATS JetStream did not answer (a server failing over, or a cluster without a quorum); retry shortly",
                retry_after_s=FAILOVER_RETRY_S,
            )
        )
    except Exception:
        log.exception("unhandled error", extra={"path": request.path})
        response = _error_response(InternalError("internal error; see the box's log"))
    _count(request, CLIENT_CLOSED_REQUEST if request.get(CLIENT_GONE) else response.status, started)
    if not response.prepared:  # a stream has sent its headers already
        response.headers.update(request_id_headers(request))
    if request.get(_WITHHELD) and not response.prepared:
        # Told not to send its body yet, the client may send it now or never: read as the next request, it hung the
        # connection (a 401 for a missing key, before the body, kept it open).
        response.force_close()
    if ctx.is_draining() and not response.prepared:
        # The connection closes after this answer, which says so (`Connection: close`): the client reconnects
        # elsewhere. Not after a stream, whose headers went out keep-alive before the drain: closed under it, the
        # client's next request on it was lost; it gets that request's 503 instead.
        response.force_close()
    return response


async def _route_without_slash(request: web.Request) -> str | None:
    """The path without its trailing `/`s when that is a route (`/v1/embeddings/` for `/v1/embeddings`), else None."""
    path = request.path
    if len(path) < 2 or not path.endswith("/") or not (trimmed := path.rstrip("/")):
        return None
    if not request.rel_url.raw_path.endswith("/"):  # an escaped `%2F`: the Location would be this path, a loop (h184)
        return None
    if request.rel_url.raw_path.startswith("//"):  # a Location of `//host/...` would name another site
        return None
    match = await request.app.router.resolve(request.clone(rel_url=request.rel_url.with_path(trimmed)))
    return trimmed if match.http_exception is None else None


def _redirect(request: web.Request, path: str) -> web.Response:
    """A 308 to `path`, the same method and body (as FastAPI servers answer a trailing `/`; the openai SDK and
    `curl -L` follow it), with the error shape saying where for a client that does not."""
    error = NotFound(f"no route {request.path!r}; it is {path!r} (no trailing '/')", code="route_moved")
    response = json_response(error.body(), status=308)
    # The path and query as the client wrote them (escapes kept, `?flag` not made `?flag=`), less the trailing `/`s.
    query = request.rel_url.raw_query_string
    response.headers[hdrs.LOCATION] = request.rel_url.raw_path.rstrip("/") + (f"?{query}" if query else "")
    return response


def _from_http_exception(exc: web.HTTPException, *, serves_api: bool = True) -> FleetboxError:
    if exc.status == 404 and not serves_api:  # a worker's port: its operations only (h60: "no such route" puzzled)
        return NotFound(
            "no such route on this box: it runs models only (--role worker) and serves no inference or admin API; "
            "send requests to a gateway (--role gateway or all)",
            code="route_not_found",
        )
    if exc.status == 404:
        return NotFound("no such route; see /openapi.json for the API", code="route_not_found")
    if exc.status == 405:
        return MethodNotAllowed.allowing(exc.headers.get("Allow", ""))
    if exc.status == 413:
        return PayloadTooLarge("request body too large")
    error = FleetboxError(exc.reason or "HTTP error")
    error.status = exc.status
    error.type = "invalid_request_error" if exc.status < 500 else "server_error"
    error.code = (exc.reason or "http_error").lower().replace(" ", "_")
    return error


async def _unknown_model_verb(request: web.Request) -> web.Response:
    """`POST /v1/models/{name}/{verb}` for a verb there is none of (a model's own path takes no POST)."""
    path = f"{request.match_info['name']}/{request.match_info['verb']}"
    if GatewayContext.of(request).catalog.get(path) is not None:
        raise MethodNotAllowed.allowing("DELETE,GET,HEAD,PATCH")
    raise NotFound(
        f"no such route: POST /v1/models/{{name}}/VERB takes the verbs {', '.join(MODEL_VERBS)}, "
        f"not {request.match_info['verb']!r}",
        code="route_not_found",
    )


def _error_response(error: FleetboxError) -> web.Response:
    response = json_response(error.body(), status=error.status, headers=error.headers)
    return response


def _answers_for_deleted_models(dispatcher: Dispatcher) -> Callable[[str, ModelSpec | None], None]:
    """A catalog listener: a model deleted (here or on another box) has its awaited requests answered 404 at
    once, rather than at their deadline: its queue is emptied and no box would answer them."""

    def on_change(name: str, spec: ModelSpec | None) -> None:
        if spec is None:
            dispatcher.abandon_model(name, model_deleted(name))

    return on_change


# The request's `100 Continue` was not sent: its body may come or not.
_WITHHELD: web.RequestKey[bool] = web.RequestKey("fbx_continue_withheld", bool)
# An `Expect` other than 100-continue: answered 417 by the middleware, as every error is.
_UNKNOWN_EXPECT: web.RequestKey[str] = web.RequestKey("fbx_unknown_expect", str)


async def _continue_within_limit(request: web.Request) -> None:
    """`Expect: 100-continue`: the client waits to be told to send its body; told only when its Content-Length is
    within the limit and it presents a key the box takes (if it takes any), else the route answers 413 (or 401) at
    once, before the body is sent (curl asks so for any body over 1 MB: it uploaded all 9 MB of one, then got the
    413). Otherwise as aiohttp's own handler."""
    if request.version < HttpVersion11:
        return
    if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
        request[_UNKNOWN_EXPECT] = request.headers[hdrs.EXPECT]
        request[_WITHHELD] = True
        return
    limit = GatewayContext.of(request).settings.max_body_bytes
    if (request.content_length is not None and request.content_length > limit) or not may_send_body(request):
        request[_WITHHELD] = True  # the route answers 413 (or 401) at once, before the body is sent
        return
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # as aiohttp's own handler: the 100 is not part of the answer's size


def _post(path: str, handler: Handler) -> web.RouteDef:
    return web.post(path, handler, expect_handler=_continue_within_limit)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """`Server: fleetbox`, where aiohttp's named its own and Python's versions to anyone who asked (tester h187)."""
    response.headers[hdrs.SERVER] = "fleetbox"


def build_app(context: GatewayContext) -> web.Application:
    # auto_decompress off: read_body decodes a compressed body itself, so a bad one is a 4xx in the error shape.
    app = web.Application(
        middlewares=[cors.preflight, errors_and_metrics],  # a preflight is answered even while the box drains
        client_max_size=context.settings.max_body_bytes,
        handler_args={"auto_decompress": False},
    )
    app[CONTEXT] = context
    app[RECEIVING] = Receiving(context.settings.max_receiving_bytes)
    app[IN_FLIGHT] = {}
    app.on_response_prepare.append(_server_header)
    if context.settings.cors_origin_list:
        app.on_response_prepare.append(cors.add_headers)
    routes = [
        web.get("/healthz", ops.healthz),
        web.get("/readyz", ops.readyz),
        web.get("/health", ops.readyz),  # TEI's (and huggingface_hub's `health_check`): 200 only when it can serve
        web.get("/metrics", metrics_guard(ops.metrics)),
        web.get("/openapi.json", openapi.document),
    ]
    if context.dispatcher is not None:  # a gateway: the API; a worker-only box serves operations only
        context.store.on_change(_answers_for_deleted_models(context.dispatcher))
        routes.append(web.get("/v1/models", inference(ops.list_models)))
        routes.append(web.get("/models", inference(ops.list_models_infinity)))  # Infinity's, at its server's root
        routes.append(web.get("/v1/models/{name:.+}", inference(admin.get_model)))
        routes.append(_post("/v1/models", admin_only(admin.register_model)))
        for verb in MODEL_VERBS:
            routes.append(_post(f"/v1/models/{{name:.+}}/{verb}", admin_only(getattr(admin, f"{verb}_model"))))
        # After the verbs: a model name may hold a `/`, so any other last segment would match GET's route.
        routes.append(_post("/v1/models/{name:.+}/{verb}", admin_only(_unknown_model_verb)))  # no probing for names
        routes.append(web.delete("/v1/models/{name:.+}", admin_only(admin.delete_model)))
        routes.append(
            web.patch("/v1/models/{name:.+}", admin_only(admin.update_model), expect_handler=_continue_within_limit)
        )
        for path in ("/v1/embeddings", "/embeddings"):  # the latter: Infinity's, at its server's root
            routes.append(_post(path, inference(encoders.create_embeddings)))
        for path in ("/v1/rerank", "/v2/rerank"):
            routes.append(_post(path, inference(encoders.rerank)))
        routes.append(_post("/rerank", inference(tei.rerank_at_root)))  # TEI's shape, or Infinity's
        routes.append(_post("/embed", inference(tei.embed_tei)))  # TEI's
        routes.append(_post("/predict", inference(tei.predict_tei)))  # TEI's
        routes.append(_post("/similarity", inference(tei.similarity_tei)))  # TEI's
        routes.append(web.get("/info", inference(tei_info.info)))  # TEI's: its one model and limits
        # A TEI base URL per model; the suffixes first: a model name may hold a `/`.
        for method, suffix, handler in tei_models.SUFFIX_ROUTES:
            route = _post if method == "POST" else web.get
            routes.append(route(f"/tei/{{name:.+}}/{suffix}", inference(handler)))
        routes.append(_post("/tei/{name:.+}", inference(tei_models.root)))
        for path in ("/", "/invocations"):  # TEI's: the route of its one model's task
            routes.append(_post(path, inference(tei.tei_root)))
        for path in ("/v1/classify", "/classify"):  # the latter: Infinity's, at its server's root
            routes.append(_post(path, inference(encoders.classify)))
        routes.append(_post("/v1/extract", inference(encoders.extract)))
        routes.append(_post("/v1/completions", inference(generation.completions)))
        routes.append(_post("/v1/chat/completions", inference(generation.chat_completions)))
    app.add_routes(routes)
    return app
