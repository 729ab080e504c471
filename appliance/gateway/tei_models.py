"""A TEI base URL per model: `/tei/{name}` serves one model's TEI routes as a TEI server serves its one model's, so
a TEI client (huggingface_hub's `InferenceClient(model=f"{box}/tei/{name}")`) works on a fleet of many models.

Each route is the root route's handler with the model the URL names: a body's own `model` must be that model
(by name or alias) or be left out. A name may hold `/`: the suffix routes are matched before the bare one.
"""

from __future__ import annotations

from aiohttp import web

from appliance.catalog import ModelSpec
from appliance.errors import Unprocessable
from appliance.gateway import tei, tei_info
from appliance.gateway.admin import known_model
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import json_response, read_body
from runtimes import Task


def _served(request: web.Request) -> ModelSpec:
    return known_model(GatewayContext.of(request), request)


async def root(request: web.Request) -> web.StreamResponse:
    """`POST /tei/{name}`: TEI's `POST /`, the route of the model's task."""
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
    spec = _served(request)
    if spec.task not in (Task.EMBED, Task.CLASSIFY, Task.SCORE):
        raise Unprocessable(
            f"model {spec.name} serves {spec.task}; TEI's routes serve embedding, classification and rerank models",
            code="wrong_task",
        )
    return json_response(await tei_info.model_info(GatewayContext.of(request), spec))


# The routes under a model's TEI URL, matched before `POST /tei/{name}` (a name may end in any of these words).
SUFFIX_ROUTES = (
    ("POST", "embed", embed),
    ("POST", "predict", predict),
    ("POST", "rerank", rerank),
    ("POST", "similarity", similarity),
    ("GET", "info", info),
)
