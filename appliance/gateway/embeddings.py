"""`POST /v1/embeddings`, the OpenAI shape: validate, enqueue, and format the vectors that come back."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
from aiohttp import web

from appliance.errors import PayloadTooLarge, Unprocessable, error_from_reply
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import decode, json_response, read_body, request_timeout
from appliance.schemas import EmbeddingRequest
from runtimes import Task

_decoder = msgspec.json.Decoder(EmbeddingRequest)


async def create_embeddings(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    body = await read_body(request, ctx.settings)
    parsed = decode(body, _decoder)
    texts = parsed.texts()
    if not texts:
        raise Unprocessable("`input` is empty; send a string or a non-empty list of strings", code="empty_input")
    if len(texts) > ctx.settings.max_inputs:
        raise PayloadTooLarge(
            f"{len(texts)} inputs is more than the limit of {ctx.settings.max_inputs} per request",
            code="too_many_inputs",
        )
    for index, text in enumerate(texts):
        if not text:
            raise Unprocessable(f"input {index} is an empty string", code="empty_input")
    spec = ctx.catalog.resolve(parsed.model)
    if spec.task is not Task.EMBED:
        raise Unprocessable(f"model {spec.name} serves {spec.task}, not embeddings", code="wrong_task")
    reply = await ctx.dispatcher.call(
        spec=spec,
        task=Task.EMBED.value,
        body=body,
        timeout_s=request_timeout(request, parsed.timeout, ctx.settings),
        tokens=sum(len(text) for text in texts) // 4 + 2 * len(texts),
    )
    if reply.meta.status != 200:
        raise error_from_reply(reply.meta.status, reply.body)
    vectors = np.frombuffer(reply.body, dtype="<f4").reshape(reply.meta.rows, reply.meta.dims)
    if parsed.encoding_format == "base64":
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode()}
            for i, row in enumerate(vectors)
        ]
    else:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
    usage = reply.meta.usage_tokens
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": spec.name,
            "usage": {"prompt_tokens": usage, "total_tokens": usage},
        },
        headers=_timing_headers(reply.meta),
    )


def _timing_headers(meta) -> dict[str, str]:
    return {
        "Fbx-Box": meta.box,
        "Fbx-Queue-Ms": f"{meta.queue_ms:.2f}",
        "Fbx-Compute-Ms": f"{meta.compute_ms:.2f}",
    }
