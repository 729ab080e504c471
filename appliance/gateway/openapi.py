"""The OpenAPI document, generated from the same msgspec schemas the routes validate with.

It lists the routes this box mounts: a worker-only box serves the operations routes alone.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
from aiohttp import web

from appliance import __version__
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import json_response
from appliance.generation_schemas import ChatRequest, CompletionRequest
from appliance.schemas import (
    BoxTarget,
    ClassifyRequest,
    EmbeddingRequest,
    ExtractRequest,
    ModelRegistration,
    ModelUpdate,
    RerankRequest,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiRerankRequest,
    TeiSimilarityRequest,
)

_SCHEMAS = (
    EmbeddingRequest,
    RerankRequest,
    TeiRerankRequest,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiSimilarityRequest,
    ClassifyRequest,
    ExtractRequest,
    CompletionRequest,
    ChatRequest,
    ModelRegistration,
    ModelUpdate,
    BoxTarget,
)
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}},
        }
    },
}
# 417: an `Expect` other than 100-continue, on any route that takes a body; 429 on the reads too: the per-key limit.
_INFERENCE_ERRORS = (400, 401, 404, 408, 413, 415, 417, 422, 429, 503, 504, 507)
_ADMIN_ERRORS = (400, 401, 403, 404, 408, 409, 413, 415, 417, 422, 429, 503, 507)
_READ_ERRORS = (401, 429)
_MODEL_HEALTH_ERRORS = (*_READ_ERRORS, 404, 422, 503)
_TEI_KINDS = ("Embed", "Predict", "Rerank", "Similarity")
_NAME = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]


def _errors(statuses: tuple[int, ...]) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/Error"}
    return {str(s): {"description": "error", "content": {"application/json": {"schema": ref}}} for s in statuses}


def _operation(summary: str, schema: str | None, errors: tuple[int, ...], ok: str = "200") -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {ok: {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}
        | _errors(errors),
    }
    if schema is not None:
        operation["requestBody"] = {
            "required": schema != "BoxTarget",
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
        }
    return operation


def _get(summary: str, errors: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"get": _operation(summary, None, errors)}


async def document(request: web.Request) -> web.Response:
    return json_response(openapi_spec(api=GatewayContext.of(request).dispatcher is not None))


@cache
def openapi_spec(api: bool = True) -> dict[str, Any]:
    """The whole API, or (`api=False`, a worker-only box) the operations routes only."""
    operations: dict[str, Any] = {
        "/healthz": _get("Liveness"),
        "/readyz": _get("Readiness: NATS, the stream, pinned models resident", (503,)),
        "/health": _get("TEI's health route: the same as /readyz", (503,)),
        "/metrics": _get("Prometheus metrics", (401,)),
        "/openapi.json": _get("This document"),
    }
    if not api:
        return _document(operations, {"Error": _ERROR})
    _, components = msgspec.json.schema_components(_SCHEMAS, ref_template="#/components/schemas/{name}")
    components["Error"] = _ERROR
    # The schema reads OpenAI's token-id inputs only to refuse them by name (422): not what the API takes.
    text = {"type": "string"}
    components["EmbeddingRequest"]["properties"]["input"] = {"anyOf": [text, {"type": "array", "items": text}]}
    components["TeiEmbedRequest"]["properties"]["inputs"] = {"anyOf": [text, {"type": "array", "items": text}]}
    paths: dict[str, Any] = {
        "/v1/embeddings": {"post": _operation("Embeddings (OpenAI)", "EmbeddingRequest", _INFERENCE_ERRORS)},
        "/embeddings": {
            "post": _operation("Embeddings: /v1/embeddings at Infinity's path", "EmbeddingRequest", _INFERENCE_ERRORS)
        },
        "/v1/classify": {"post": _operation("Sequence labels per input", "ClassifyRequest", _INFERENCE_ERRORS)},
        "/classify": {
            "post": _operation("Sequence labels: /v1/classify at Infinity's path", "ClassifyRequest", _INFERENCE_ERRORS)
        },
        "/v1/extract": {"post": _operation("Entity spans per input", "ExtractRequest", _INFERENCE_ERRORS)},
        "/v1/completions": {"post": _operation("Text completion (OpenAI)", "CompletionRequest", _INFERENCE_ERRORS)},
        "/v1/chat/completions": {"post": _operation("Chat completion (OpenAI)", "ChatRequest", _INFERENCE_ERRORS)},
        "/v1/models": {
            **_get("The catalog, with where each model is resident", _READ_ERRORS),
            "post": _operation("Register a model folder or LoRA adapter", "ModelRegistration", _ADMIN_ERRORS, "201"),
        },
        "/models": _get("The catalog: /v1/models at Infinity's path, without `owned_by`", _READ_ERRORS),
        "/v1/models/{name}": {
            "get": {**_operation("One model", None, (*_READ_ERRORS, 404)), "parameters": _NAME},
            "delete": {**_operation("Remove a model from the catalog", None, _ADMIN_ERRORS), "parameters": _NAME},
            "patch": {
                **_operation("Change a model's aliases, pin or batching in place", "ModelUpdate", _ADMIN_ERRORS),
                "parameters": _NAME,
            },
        },
    }
    for path in ("/v1/rerank", "/v2/rerank"):
        paths[path] = {"post": _operation("Rerank documents (Cohere/Jina)", "RerankRequest", _INFERENCE_ERRORS)}
    tei = _operation("Rerank documents (TEI's shape with `texts`, else Infinity's)", "RerankRequest", _INFERENCE_ERRORS)
    either = [{"$ref": f"#/components/schemas/{name}"} for name in ("RerankRequest", "TeiRerankRequest")]
    tei["requestBody"]["content"]["application/json"]["schema"] = {"oneOf": either}
    tei["responses"]["200"]["content"]["application/json"]["schema"] = {"type": ["object", "array"]}  # TEI's: a list
    paths["/rerank"] = {"post": tei}
    # TEI's answers are bare lists: vectors; for /predict a list of {label, score}, or one such list per input.
    for path, summary, schema in (
        ("/embed", "Embeddings (TEI's shape): a list of vectors", "TeiEmbedRequest"),
        ("/predict", "Sequence labels (TEI's shape): one list, or one per input of a batch", "TeiPredictRequest"),
        ("/similarity", "Cosine similarity of a sentence to others (TEI's shape): a list", "TeiSimilarityRequest"),
    ):
        operation = _operation(summary, schema, _INFERENCE_ERRORS)
        operation["responses"]["200"]["content"]["application/json"]["schema"] = {"type": "array"}
        paths[path] = {"post": operation}
    one_model = "TEI's info on the fleet's one embedding, classification or rerank model"
    paths["/info"] = _get(one_model, (*_READ_ERRORS, 422))
    tei_bodies = {"oneOf": [{"$ref": f"#/components/schemas/Tei{kind}Request"} for kind in _TEI_KINDS]}
    # A TEI base URL per model: the root routes' bodies and answers, for the model the path names.
    for suffix, schema in (
        ("", None),
        ("/embed", "TeiEmbedRequest"),
        ("/predict", "TeiPredictRequest"),
        ("/rerank", "TeiRerankRequest"),
        ("/similarity", "TeiSimilarityRequest"),
    ):
        operation = _operation(f"TEI's POST {suffix or '/'} for the model `name`", schema, _INFERENCE_ERRORS)
        if schema is None:  # the route of the model's task: any of TEI's bodies
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": tei_bodies}}}
        operation["responses"]["200"]["content"]["application/json"]["schema"] = {"type": "array"}
        paths[f"/tei/{{name}}{suffix}"] = {"post": {**operation, "parameters": _NAME}}
    paths["/tei/{name}/info"] = {
        "get": {**_operation("TEI's info on the model `name`", None, (*_READ_ERRORS, 404, 422)), "parameters": _NAME}
    }
    paths["/tei/{name}/health"] = {
        "get": {
            **_operation("TEI's health of the model `name`: this box's readiness", None, _MODEL_HEALTH_ERRORS),
            "parameters": _NAME,
        }
    }
    for path in ("/", "/invocations"):  # TEI's: the route of the named model's task, or of the fleet's one
        summary = "TEI's route of the model's task: /embed, /predict or /rerank; /similarity for object `inputs`"
        operation = _operation(summary, None, _INFERENCE_ERRORS)
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": tei_bodies}}}
        operation["responses"]["200"]["content"]["application/json"]["schema"] = {"type": "array"}
        paths[path] = {"post": operation}
    for verb in ("pin", "unpin"):
        paths[f"/v1/models/{{name}}/{verb}"] = {
            "post": {**_operation(f"{verb.title()} a model fleet-wide", None, _ADMIN_ERRORS), "parameters": _NAME}
        }
    for verb in ("load", "evict"):
        paths[f"/v1/models/{{name}}/{verb}"] = {
            "post": {**_operation(f"{verb.title()} a model on a box", "BoxTarget", _ADMIN_ERRORS), "parameters": _NAME}
        }
    return _document(paths | operations, components)


def _document(paths: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "fleetbox", "version": __version__},
        "paths": paths,
        "components": {"schemas": components},
    }
