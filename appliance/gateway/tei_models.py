"""A TEI base URL per model: `/tei/{name}` serves one model's TEI routes as a TEI server serves its one model's, so
a TEI client (huggingface_hub's `InferenceClient(model=f"{box}/tei/{name}")`) works on a fleet of many models.

Each route is the root route's handler with the model the URL names: a body's own `model` must be that model
(by name or alias) or be left out. A name may hold `/`: the suffix routes are matched before the bare one.
"""

from __future__ import annotations

from aiohttp import web

from appliance.catalog import ModelSpec
from appliance.errors import MethodNotAllowed, NotFound, Unprocessable
from appliance.gateway import ops, tei, tei_info
from appliance.gateway.admin import known_model
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import json_response, read_body
from runtimes import Task


def _served(request: web.Request) -> ModelSpec:
    return known_model(GatewayContext.of(request), request)


def _tei_served(request: web.Request) -> ModelSpec:
    """The model the URL names, which must be of a task TEI's routes serve."""
    spec = _served(request)
    if spec.task not in (Task.EMBED, Task.CLASSIFY, Task.SCORE):
        raise Unprocessable(
            f"model {spec.name} serves {spec.task}; TEI's routes serve embedding, classification and rerank models",
            code="wrong_task",
        )
    return spec


async def root(request: web.Request) -> web.StreamResponse:
    """`POST /tei/{name}`: TEI's `POST /`, the route of the model's task. A name no model has whose last segment is
    one of the suffix routes is that route of a model asked with the wrong method: a 405, as aiohttp says for the
    others (tester h96: `POST /tei/{name}/info` was a 404 for a model called `{name}/info`)."""
    name = request.match_info["name"]
    catalog = GatewayContext.of(request).catalog
    model, _, suffix = name.rpartition("/")
    if catalog.get(name) is None and suffix in _METHODS and catalog.get(model) is not None:
        if request.method not in _METHODS[suffix].split(","):
            raise MethodNotAllowed.allowing(_METHODS[suffix])
        # `POST /tei/noop%2Fembed`: the `/` escaped, which aiohttp's routes keep apart (tester h121: "allowed: POST"
        # told a POST).
        raise NotFound(
            f"model {name!r} does not exist; the {suffix} route of model {model!r} is /tei/{model}/{suffix}, "
            "with the '/' before its last segment not escaped (%2F)",
            code="model_not_found",
        )
    return await tei.tei_root(request, _served(request).name)


async def embed(request: web.Request) -> web.Response:
    name = _served(request).name
    return await tei.embed_tei(request, await read_body(request, GatewayContext.of(request).settings), name)


async def predict(request: web.Request) -> web.Response:
    name = _served(request).name
    return await tei.predict_tei(request, await read_body(request, GatewayContext.of(request).settings), name)


async def rerank(request: web.Request) -> web.Response:
    name = _served(request).name
    return await tei.rerank_at_root(request, await read_body(request, GatewayContext.of(request).settings), name)


async def similarity(request: web.Request) -> web.Response:
    name = _served(request).name
    return await tei.similarity_tei(request, await read_body(request, GatewayContext.of(request).settings), name)


async def info(request: web.Request) -> web.Response:
    """`GET /tei/{name}/info`: TEI's `GET /info` of the model."""
    return json_response(await tei_info.model_info(GatewayContext.of(request), _tei_served(request)))


async def health(request: web.Request) -> web.Response:
    """`GET /tei/{name}/health`: TEI's `GET /health` of the model, which huggingface_hub's `health_check` asks at
    the client's URL: the box's readiness (`/health`), for a model of TEI's tasks it knows (tester h96: a 405, so a
    per-model client's health check was always false)."""
    _tei_served(request)
    return await ops.readyz(request)


# The routes under a model's TEI URL, matched before `POST /tei/{name}` (a name may end in any of these words).
SUFFIX_ROUTES = (
    ("POST", "embed", embed),
    ("POST", "predict", predict),
    ("POST", "rerank", rerank),
    ("POST", "similarity", similarity),
    ("GET", "info", info),
    ("GET", "health", health),
)
_METHODS = {suffix: "GET,HEAD" if method == "GET" else method for method, suffix, _ in SUFFIX_ROUTES}
