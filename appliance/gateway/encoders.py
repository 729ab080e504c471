"""The encoder API families: embeddings (OpenAI), rerank (Cohere/Jina, and Infinity's), classify (Infinity's
too) and extract.

Each route validates with its schema, resolves the model (and adapter), checks the model serves
the route's task, enqueues the client's bytes unchanged, and shapes the worker's compact reply.
TEI's routes (`tei.py`) queue their requests here, as the fleetbox requests they stand for.
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
from appliance.errors import PayloadTooLarge, Unprocessable, error_from_reply, too_many_dimensions
from appliance.gateway.context import REQUEST_ID, GatewayContext
from appliance.gateway.http import decode, json_response, read_body, request_priority, request_timeout
from appliance.schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    ExtractRequest,
    RerankRequest,
    SentDocuments,
)
from runtimes import Task

# Where each task is served: named when a request asks a model for another task.
ROUTE_FOR = {
    Task.EMBED: "/v1/embeddings",
    Task.SCORE: "/v1/rerank",
    Task.CLASSIFY: "/v1/classify",
    Task.EXTRACT: "/v1/extract",
    Task.GENERATE: "/v1/chat/completions or /v1/completions",
}

# The `model` Infinity's client sends when its user names none: read as `model` left out, as TEI's (`the_one_model`).
# The worker never reads a body's `model`: the request's queue is its model's.
INFINITY_UNNAMED = "default/not-specified"

# An input weighs no more than this in the gateway's estimate: most encoders take at most 512 tokens and
# truncate longer inputs (or refuse them), and the catalog does not say each model's own limit.
_MAX_INPUT_TOKENS = 512

_decoders: dict[type, msgspec.json.Decoder] = {
    schema: msgspec.json.Decoder(schema)
    for schema in (
        EmbeddingRequest,
        RerankRequest,
        SentDocuments,
        ClassifyRequest,
        ExtractRequest,
    )
}


async def enqueue(
    request: web.Request, schema: type, task: Task, body: bytes | None = None, *, field: str | None = None
) -> tuple[Any, Resolved, ReplyMeta, bytes]:
    """Validate the request (`body`, or the one read now), queue it for its model, and await the worker's reply.

    `field` is what the client called its inputs, where that is not this schema's name for them (a TEI request,
    re-encoded as fleetbox's, is told of its `inputs`, not of an `input` it never sent)."""
    field = field or ("documents" if task is Task.SCORE else "input")
    ctx = GatewayContext.of(request)
    if body is None:
        body = await read_body(request, ctx.settings)
    parsed = decode(body, _decoders[schema])
    if isinstance(parsed, RerankRequest) and (parsed.max_chunks_per_doc or 1) > 1:
        raise Unprocessable(
            f"`max_chunks_per_doc` {parsed.max_chunks_per_doc}: fleetbox scores each document whole, cut to the "
            "model's length (or to `max_tokens_per_doc`), not as the best of several chunks; leave it out or send 1",
            code="unsupported_parameter",
        )
    if isinstance(parsed, RerankRequest) and parsed.rank_fields not in (None, ["text"]):
        # Ignored, the ranking changed without a word: documents alike in `text` ranked by chance (tester h121).
        raise Unprocessable(
            f"`rank_fields` {parsed.rank_fields}: fleetbox ranks each document by its `text` only; put what is to "
            "be ranked in `text` (Cohere suggests one string, such as YAML, of the fields), or leave it out or send "
            '["text"]',
            code="unsupported_parameter",
        )
    if isinstance(parsed, ClassifyRequest) and parsed.raw_scores and parsed.function_to_apply in ("softmax", "sigmoid"):
        raise Unprocessable(
            f"`raw_scores` asks for the logits and `function_to_apply` {parsed.function_to_apply!r} for the "
            f"{parsed.function_to_apply} of them; send one of the two",
            code="invalid_input",
        )
    if isinstance(parsed, EmbeddingRequest):
        refuse_other_embeddings(parsed)
    texts: list[str] = parsed.texts()
    refuse_token_ids(
        texts,
        f"`{field}` holds token ids; fleetbox embeds text with the model's own tokenizer: send strings (with "
        "LangChain's OpenAIEmbeddings, set check_embedding_ctx_length=False, which sends tiktoken's ids)",
    )
    _check_inputs(texts, ctx.settings.max_inputs, field)
    model = parsed.model
    if model is None:  # left out: as Infinity's server and TEI read it (tester h96: a 422 for the missing field)
        model = the_one_model(ctx, task)
    elif model == INFINITY_UNNAMED and ctx.catalog.get(model) is None:
        model = the_one_model(ctx, task, f"`model` is {INFINITY_UNNAMED!r} (Infinity's client's for none)")
    resolved = ctx.catalog.resolve(model, parsed.adapter)
    if resolved.spec.task is not task:
        raise Unprocessable(
            f"model {resolved.name} serves {resolved.spec.task}, not {task}; "
            f"send it to {ROUTE_FOR[resolved.spec.task]}",
            code="wrong_task",
        )
    if isinstance(parsed, EmbeddingRequest) and parsed.dimensions is not None:
        _check_width(ctx, resolved.spec.name, parsed.dimensions)
    ctx.refuse_without_workers()
    reply = await ctx.dispatcher.call(
        spec=resolved.spec,
        task=task.value,
        body=body,
        timeout_s=request_timeout(request, parsed.timeout, ctx.settings),
        tokens=estimate_tokens(texts),
        inputs=len(texts),
        adapter=resolved.adapter,
        priority=request_priority(request),
        request_id=request[REQUEST_ID],
    )
    if reply.meta.status != 200:
        raise error_from_reply(reply.meta.status, reply.body, reply.meta.retry_after_s)
    return parsed, resolved, reply.meta, reply.body


def _check_width(ctx: GatewayContext, model: str, dimensions: int) -> None:
    """A 422 now for `dimensions` past the width the live boxes holding `model` say in their heartbeats (one width:
    while a re-registration on another folder spreads, they may differ, and the worker judges). Judged after
    admission, under load the request was refused 429, to be retried for ever (tester h70)."""
    widths = {
        entry.get("dimensions")
        for record in ctx.live_boxes()
        for entry in record.get("models", [])
        if entry.get("name") == model and entry.get("state") == "resident"
    }
    if len(widths) == 1 and isinstance(width := next(iter(widths)), int) and dimensions > width:
        raise too_many_dimensions(dimensions, width)


def refuse_other_embeddings(parsed: EmbeddingRequest) -> None:
    """A 422 for another server's embedding field asking for what fleetbox does not do: ignored, the answer would be
    another embedding than the one asked for, without a word."""
    if parsed.modality not in (None, "text"):
        raise Unprocessable(
            f"`modality` {parsed.modality!r}: fleetbox embeds text only; send text, or leave `modality` out or "
            'send "text"',
            code="unsupported_parameter",
        )
    if parsed.truncate_prompt_tokens not in (None, -1):
        raise Unprocessable(
            f"`truncate_prompt_tokens` {parsed.truncate_prompt_tokens}: fleetbox cuts an input only at the model's "
            "length (`truncate`); leave it out or send -1",
            code="unsupported_parameter",
        )
    if parsed.truncate_prompt_tokens == -1 and parsed.truncate is False:
        raise Unprocessable(
            "`truncate_prompt_tokens` -1 asks to cut an input at the model's length and `truncate` false forbids it; "
            "send one of them"
        )
    if parsed.add_special_tokens is False:
        raise Unprocessable(
            "`add_special_tokens` false: fleetbox embeds with the model's special tokens, as sentence-transformers "
            "does; leave it out or send true",
            code="unsupported_parameter",
        )


def refuse_token_ids(texts: list[Any], refusal: str) -> None:
    """Strings only: token ids (integers, or lists of them) are refused saying `refusal`; anything else that is not
    a string (a null, an object, a mix) is `invalid_input` naming the first (`[null]` was told it held token ids)."""
    if all(isinstance(text, str) for text in texts):
        return
    if all(_token_ids(text) for text in texts):
        raise Unprocessable(refusal, code="unsupported_parameter")
    first = next(i for i, text in enumerate(texts) if not isinstance(text, str))
    raise Unprocessable(f"input {first} is not a string; send a string or a list of strings")


def _token_ids(value: Any) -> bool:
    """An integer, or a non-empty list of integers: OpenAI's and TEI's token-id inputs."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    return isinstance(value, int) and not isinstance(value, bool)


def estimate_tokens(texts: list[str]) -> int:
    """What a request costs its model, cheaply: about 4 characters a token, 2 more per input, at most 512 each."""
    return sum(min(len(text) // 4 + 2, _MAX_INPUT_TOKENS) for text in texts)


def _check_inputs(texts: list[str], max_inputs: int, field: str) -> None:
    if not texts:
        raise Unprocessable(f"`{field}` is empty; send a string or a non-empty list of strings", code="empty_input")
    item = field.removesuffix("s")  # one of them: an input, a document, a text
    if len(texts) > max_inputs:
        raise PayloadTooLarge(
            f"{len(texts)} {item}s is more than the limit of {max_inputs} per request", code="too_many_inputs"
        )
    for index, text in enumerate(texts):
        if not text:
            raise Unprocessable(f"{item} {index} is an empty string", code="empty_input")


def timing(meta: ReplyMeta) -> dict[str, str]:
    return {"Fbx-Box": meta.box, "Fbx-Queue-Ms": f"{meta.queue_ms:.2f}", "Fbx-Compute-Ms": f"{meta.compute_ms:.2f}"}


def _usage(meta: ReplyMeta) -> dict[str, int]:
    return {"prompt_tokens": meta.usage_tokens, "total_tokens": meta.usage_tokens}


async def create_embeddings(request: web.Request) -> web.Response:
    parsed, resolved, meta, body = await enqueue(request, EmbeddingRequest, Task.EMBED)
    vectors = np.frombuffer(body, dtype="<f4").reshape(meta.rows, meta.dims)
    if parsed.encoding_format == "base64":
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode()}
            for i, row in enumerate(vectors)
        ]
    else:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
    payload = {"object": "list", "data": data, "model": resolved.name, "usage": _usage(meta)}
    return json_response(payload, headers=timing(meta))


async def rerank(request: web.Request, body: bytes | None = None, *, infinity: bool = False) -> web.Response:
    """Cohere's and Jina's rerank (Infinity's too): results best first, each document as it was sent if asked; a
    string document as `{"text": ...}` (Cohere's v1), or as the string itself with `infinity` (Infinity's answer,
    whose client types a result's `document` as a string)."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    parsed, resolved, meta, reply = await enqueue(request, RerankRequest, Task.SCORE, body)
    scores = np.frombuffer(reply, dtype="<f4")
    order = np.argsort(-scores, kind="stable")
    if parsed.top_n is not None:
        order = order[: parsed.top_n]
    # An object comes back as it was written, its other fields (a title, an id) kept, as Cohere's API does: its
    # JSON unparsed, so no number is read differently (a 1e400, a 23-digit id).
    sent = decode(body, _decoders[SentDocuments]).documents if parsed.return_documents else []
    results = []
    for index in order.tolist():
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if parsed.return_documents:
            raw = bytes(sent[index])
            document = orjson.Fragment(raw)
            result["document"] = document if infinity or raw.startswith(b"{") else {"text": document}
        results.append(result)
    payload = {
        "id": request[REQUEST_ID],
        "object": "rerank",
        "model": resolved.name,
        "results": results,
        "usage": _usage(meta),
    }
    return json_response(payload, headers=timing(meta))


# What a request without `model` is missing, per task, in the 422 that says so.
MODEL_KIND = {
    Task.EMBED: "embedding model",
    Task.SCORE: "reranker",
    Task.CLASSIFY: "classifier",
    Task.EXTRACT: "entity extractor",
}


def the_one_model(ctx: GatewayContext, task: Task, unnamed: str = "`model` is missing") -> str:
    """The model a TEI (or Infinity) request that names none means: the catalog's only model of its task (a TEI
    server serves one model); else a 422 naming the ones to choose from, saying how the model went unnamed."""
    names = [spec.name for spec in ctx.catalog if spec.task is task and spec.adapter_of is None]
    if len(names) == 1:
        return names[0]
    kind = MODEL_KIND[task]
    if not names:
        raise Unprocessable(f"{unnamed}, and this fleet has no {kind} (`{task}` model)", code="model_required")
    raise Unprocessable(
        f"{unnamed}, and this fleet has {len(names)} {kind}s: name one of {', '.join(names)}",
        code="model_required",
    )


async def classify(request: web.Request) -> web.Response:
    return await _per_input(request, ClassifyRequest, Task.CLASSIFY)


async def extract(request: web.Request) -> web.Response:
    return await _per_input(request, ExtractRequest, Task.EXTRACT)


async def _per_input(request: web.Request, schema: type, task: Task) -> web.Response:
    """Classify and extract: the worker's JSON (one list per input) passes through unparsed."""
    _, resolved, meta, body = await enqueue(request, schema, task)
    payload = {
        "object": task.value,
        "model": resolved.name,
        "data": orjson.Fragment(body),
        "usage": _usage(meta),
    }
    return json_response(payload, headers=timing(meta))
