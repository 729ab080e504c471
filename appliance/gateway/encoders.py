"""The encoder API families: embeddings (OpenAI), rerank (Cohere/Jina), classify (Infinity), extract.

Each route validates with its schema, resolves the model (and adapter), checks the model serves
the route's task, enqueues the client's bytes unchanged, and shapes the worker's compact reply.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np
import orjson
from aiohttp import web

from appliance.catalog import Resolved
from appliance.envelope import ReplyMeta
from appliance.errors import PayloadTooLarge, Unprocessable, error_from_reply
from appliance.gateway.context import REQUEST_ID, GatewayContext
from appliance.gateway.http import decode, json_response, read_body, request_priority, request_timeout
from appliance.schemas import ClassifyRequest, EmbeddingRequest, ExtractRequest, RerankRequest
from runtimes import Task

# An input weighs no more than this in the gateway's estimate: most encoders take at most 512 tokens and
# truncate longer inputs (or refuse them), and the catalog does not say each model's own limit.
_MAX_INPUT_TOKENS = 512

_decoders: dict[type, msgspec.json.Decoder] = {
    schema: msgspec.json.Decoder(schema)
    for schema in (EmbeddingRequest, RerankRequest, ClassifyRequest, ExtractRequest)
}


async def _enqueue(request: web.Request, schema: type, task: Task) -> tuple[Any, Resolved, ReplyMeta, bytes]:
    ctx = GatewayContext.of(request)
    body = await read_body(request, ctx.settings)
    parsed = decode(body, _decoders[schema])
    texts: list[str] = parsed.texts()
    _check_inputs(texts, ctx.settings.max_inputs, "documents" if task is Task.SCORE else "input")
    resolved = ctx.catalog.resolve(parsed.model, parsed.adapter)
    if resolved.spec.task is not task:
        raise Unprocessable(
            f"model {resolved.spec.name} serves {resolved.spec.task}, not {task}; "
            f"use the route for {resolved.spec.task}",
            code="wrong_task",
        )
    reply = await ctx.dispatcher.call(
        spec=resolved.spec,
        task=task.value,
        body=body,
        timeout_s=request_timeout(request, parsed.timeout, ctx.settings),
        tokens=estimate_tokens(texts),
        adapter=resolved.adapter.name if resolved.adapter else None,
        priority=request_priority(request),
        request_id=request[REQUEST_ID],
    )
    if reply.meta.status != 200:
        raise error_from_reply(reply.meta.status, reply.body)
    return parsed, resolved, reply.meta, reply.body


def estimate_tokens(texts: list[str]) -> int:
    """What a request costs its model, cheaply: about 4 characters a token, 2 more per input, at most 512 each."""
    return sum(min(len(text) // 4 + 2, _MAX_INPUT_TOKENS) for text in texts)


def _check_inputs(texts: list[str], max_inputs: int, field: str) -> None:
    if not texts:
        raise Unprocessable(f"`{field}` is empty; send a string or a non-empty list of strings", code="empty_input")
    if len(texts) > max_inputs:
        raise PayloadTooLarge(
            f"{len(texts)} inputs is more than the limit of {max_inputs} per request", code="too_many_inputs"
        )
    for index, text in enumerate(texts):
        if not text:
            raise Unprocessable(f"{field} {index} is an empty string", code="empty_input")


def _model_name(resolved: Resolved) -> str:
    return resolved.adapter.name if resolved.adapter else resolved.spec.name


def _timing(meta: ReplyMeta) -> dict[str, str]:
    return {"Fbx-Box": meta.box, "Fbx-Queue-Ms": f"{meta.queue_ms:.2f}", "Fbx-Compute-Ms": f"{meta.compute_ms:.2f}"}


def _usage(meta: ReplyMeta) -> dict[str, int]:
    return {"prompt_tokens": meta.usage_tokens, "total_tokens": meta.usage_tokens}


async def create_embeddings(request: web.Request) -> web.Response:
    parsed, resolved, meta, body = await _enqueue(request, EmbeddingRequest, Task.EMBED)
    vectors = np.frombuffer(body, dtype="<f4").reshape(meta.rows, meta.dims)
    if parsed.encoding_format == "base64":
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode()}
            for i, row in enumerate(vectors)
        ]
    else:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
    payload = {"object": "list", "data": data, "model": _model_name(resolved), "usage": _usage(meta)}
    return json_response(payload, headers=_timing(meta))


async def rerank(request: web.Request) -> web.Response:
    parsed, resolved, meta, body = await _enqueue(request, RerankRequest, Task.SCORE)
    scores = np.frombuffer(body, dtype="<f4")
    order = np.argsort(-scores, kind="stable")
    if parsed.top_n is not None:
        order = order[: parsed.top_n]
    texts = parsed.texts()
    results = []
    for index in order.tolist():
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if parsed.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    payload = {
        "object": "rerank",
        "model": _model_name(resolved),
        "results": results,
        "usage": _usage(meta),
    }
    return json_response(payload, headers=_timing(meta))


async def classify(request: web.Request) -> web.Response:
    return await _per_input(request, ClassifyRequest, Task.CLASSIFY)


async def extract(request: web.Request) -> web.Response:
    return await _per_input(request, ExtractRequest, Task.EXTRACT)


async def _per_input(request: web.Request, schema: type, task: Task) -> web.Response:
    """Classify and extract: the worker's JSON (one list per input) passes through unparsed."""
    _, resolved, meta, body = await _enqueue(request, schema, task)
    payload = {
        "object": task.value,
        "model": _model_name(resolved),
        "data": orjson.Fragment(body),
        "usage": _usage(meta),
    }
    return json_response(payload, headers=_timing(meta))
