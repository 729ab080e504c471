"""The encoder API families: embeddings (OpenAI), rerank (Cohere/Jina), classify (Infinity), extract, and TEI's
`/embed`, `/predict` and `/rerank`.

Each route validates with its schema, resolves the model (and adapter), checks the model serves
the route's task, enqueues the client's bytes unchanged, and shapes the worker's compact reply.
A TEI request is queued as the fleetbox request it stands for (one worker path per task), its
`model` left out meaning the fleet's one model of the task, as a TEI server serves one.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np
import orjson
from aiohttp import web

from appliance.catalog import ModelSpec, Resolved
from appliance.envelope import ReplyMeta
from appliance.errors import PayloadTooLarge, Unprocessable, error_from_reply
from appliance.gateway.context import REQUEST_ID, GatewayContext
from appliance.gateway.http import decode, json_response, read_body, request_priority, request_timeout
from appliance.schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    ExtractRequest,
    RerankRequest,
    RerankShape,
    SentDocuments,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiRequest,
    TeiRerankRequest,
    TeiShape,
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

# The `model` Infinity's client sends when its user names none: read as `model` left out, as TEI's (`_the_one_model`).
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
        TeiRerankRequest,
        TeiEmbedRequest,
        TeiPredictRequest,
        TeiShape,
        RerankShape,
        SentDocuments,
        ClassifyRequest,
        ExtractRequest,
    )
}


async def _enqueue(
    request: web.Request, schema: type, task: Task, body: bytes | None = None
) -> tuple[Any, Resolved, ReplyMeta, bytes]:
    """Validate the request (`body`, or the one read now), queue it for its model, and await the worker's reply."""
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
    texts: list[str] = parsed.texts()
    _refuse_token_ids(
        texts,
        "`input` holds token ids; fleetbox embeds text with the model's own tokenizer: send strings (with "
        "LangChain's OpenAIEmbeddings, set check_embedding_ctx_length=False, which sends tiktoken's ids)",
    )
    _check_inputs(texts, ctx.settings.max_inputs, "documents" if task is Task.SCORE else "input")
    model = parsed.model
    if model == INFINITY_UNNAMED and ctx.catalog.get(model) is None:
        model = _the_one_model(ctx, task, f"`model` is {INFINITY_UNNAMED!r} (Infinity's client's for none)")
    resolved = ctx.catalog.resolve(model, parsed.adapter)
    if resolved.spec.task is not task:
        raise Unprocessable(
            f"model {resolved.name} serves {resolved.spec.task}, not {task}; "
            f"send it to {ROUTE_FOR[resolved.spec.task]}",
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
        raise error_from_reply(reply.meta.status, reply.body, reply.meta.retry_after_s)
    return parsed, resolved, reply.meta, reply.body


def _refuse_token_ids(texts: list[Any], refusal: str) -> None:
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
    item = "document" if field == "documents" else field
    if len(texts) > max_inputs:
        raise PayloadTooLarge(
            f"{len(texts)} inputs is more than the limit of {max_inputs} per request", code="too_many_inputs"
        )
    for index, text in enumerate(texts):
        if not text:
            raise Unprocessable(f"{item} {index} is an empty string", code="empty_input")


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
    payload = {"object": "list", "data": data, "model": resolved.name, "usage": _usage(meta)}
    return json_response(payload, headers=_timing(meta))


async def rerank(request: web.Request, body: bytes | None = None, *, infinity: bool = False) -> web.Response:
    """Cohere's and Jina's rerank (Infinity's too): results best first, each document as it was sent if asked; a
    string document as `{"text": ...}` (Cohere's v1), or as the string itself with `infinity` (Infinity's answer,
    whose client types a result's `document` as a string)."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    parsed, resolved, meta, reply = await _enqueue(request, RerankRequest, Task.SCORE, body)
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
    return json_response(payload, headers=_timing(meta))


async def rerank_at_root(request: web.Request, body: bytes | None = None, served: str | None = None) -> web.Response:
    """`/rerank`: TEI's request and answer when the body has `texts` (a bare list of `{index, score, text?}`, best
    first), else Infinity's, which is Cohere's request with a string document given back as the string (its server
    serves `/rerank` at the root; Cohere's and Jina's clients post to `/v1/rerank` or `/v2/rerank`)."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    shape = decode(body, _decoders[RerankShape])
    if shape.texts is not None and shape.documents is not None:
        raise Unprocessable("send `texts` (TEI's rerank) or `documents` (Cohere's), not both")
    if shape.texts is None:
        if served is not None:
            raise Unprocessable(f"/tei/{served}/rerank is TEI's rerank: send the documents as `texts`")
        return await rerank(request, body, infinity=True)
    tei = decode(body, _decoders[TeiRerankRequest])
    meta, reply = await _enqueue_tei(
        request, tei, RerankRequest, Task.SCORE, served, query=tei.query, documents=tei.texts, raw_scores=tei.raw_scores
    )
    scores = np.frombuffer(reply, dtype="<f4")
    results = []
    for index in np.argsort(-scores, kind="stable").tolist():
        result: dict[str, Any] = {"index": index, "score": float(scores[index])}
        if tei.return_text:
            result["text"] = tei.texts[index]
        results.append(result)
    return json_response(results, headers=_timing(meta))


async def _enqueue_tei(
    request: web.Request, tei: TeiRequest, schema: type, task: Task, served: str | None, **fields: Any
) -> tuple[ReplyMeta, bytes]:
    """A TEI request queued as the fleetbox request (`schema`) it stands for: `fields`, and what every TEI request
    carries (`model`: the model its URL serves, `served`, or the fleet's one of the task when left out; `truncate`,
    `adapter`, `timeout`)."""
    if (tei.truncation_direction or "right").lower() != "right":
        raise Unprocessable(
            f"truncation_direction {tei.truncation_direction!r}: fleetbox cuts an over-long input at its end only "
            '("right"); leave it out, or send inputs that fit with "truncate": false to be told which do not',
            code="unsupported_parameter",
        )
    ctx = GatewayContext.of(request)
    if served is not None:
        _check_agrees(ctx, tei.model, served)
    model = served or tei.model or _the_one_model(ctx, task)
    body = {"model": model, "truncate": tei.truncate, "adapter": tei.adapter, "timeout": tei.timeout, **fields}
    _, _, meta, reply = await _enqueue(request, schema, task, orjson.dumps(body))
    return meta, reply


def _check_agrees(ctx: GatewayContext, named: str | None, served: str) -> None:
    """A body sent to a model's own TEI URL names that model (by name or alias), or none."""
    if named is None:
        return
    spec = ctx.catalog.get(named)
    if spec is None or spec.name != served:
        raise Unprocessable(
            f"`model` {named!r} is not {served}, the model this URL (/tei/{served}) serves: leave `model` out, "
            "or send the request to that model's own URL",
            code="model_mismatch",
        )


# What a request without `model` is missing, per task, in the 422 that says so.
_KIND = {
    Task.EMBED: "embedding model",
    Task.SCORE: "reranker",
    Task.CLASSIFY: "classifier",
    Task.EXTRACT: "entity extractor",
}


def _the_one_model(ctx: GatewayContext, task: Task, unnamed: str = "`model` is missing") -> str:
    """The model a TEI (or Infinity) request that names none means: the catalog's only model of its task (a TEI
    server serves one model); else a 422 naming the ones to choose from, saying how the model went unnamed."""
    names = [spec.name for spec in ctx.catalog if spec.task is task and spec.adapter_of is None]
    if len(names) == 1:
        return names[0]
    kind = _KIND[task]
    if not names:
        raise Unprocessable(f"{unnamed}, and this fleet has no {kind} (`{task}` model)", code="model_required")
    raise Unprocessable(
        f"{unnamed}, and this fleet has {len(names)} {kind}s: name one of {', '.join(names)}",
        code="model_required",
    )


async def embed_tei(request: web.Request, body: bytes | None = None, served: str | None = None) -> web.Response:
    """TEI's `/embed`: a bare list of vectors, one per input, computed as `/v1/embeddings` computes them."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    tei = decode(body, _decoders[TeiEmbedRequest])
    texts = [tei.inputs] if isinstance(tei.inputs, str) else tei.inputs
    if any(isinstance(text, list) and any(isinstance(part, str) for part in text) for text in texts):
        raise Unprocessable(
            "`inputs` holds lists of strings: /embed takes a string or a list of strings (lists of one string "
            "are a /predict batch)"
        )
    _refuse_token_ids(texts, "`inputs` holds token ids; fleetbox tokenises text with the model's own tokenizer")
    if tei.prompt_name is not None:
        raise Unprocessable(
            f"`prompt_name` ({tei.prompt_name!r}): fleetbox applies no sentence-transformers prompts; "
            "prepend the prompt's text to each input instead",
            code="unsupported_parameter",
        )
    meta, reply = await _enqueue_tei(
        request,
        tei,
        EmbeddingRequest,
        Task.EMBED,
        served,
        input=texts,
        dimensions=tei.dimensions,
        normalize=tei.normalize,
    )
    return json_response(np.frombuffer(reply, dtype="<f4").reshape(meta.rows, meta.dims), headers=_timing(meta))


async def predict_tei(request: web.Request, body: bytes | None = None, served: str | None = None) -> web.Response:
    """TEI's `/predict`: labels with scores, best first, as `/v1/classify` gives them; for one input its list, for a
    batch one list per input."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    tei = decode(body, _decoders[TeiPredictRequest])
    texts, batch = _predict_inputs(tei.inputs)
    top_k, raw_scores = _predict_parameters(tei)
    meta, reply = await _enqueue_tei(
        request, tei, ClassifyRequest, Task.CLASSIFY, served, input=texts, raw_scores=raw_scores, top_k=top_k
    )
    return json_response(orjson.Fragment(reply) if batch else orjson.loads(reply)[0], headers=_timing(meta))


def _predict_parameters(tei: TeiPredictRequest) -> tuple[int | None, bool | None]:
    """`top_k` and `raw_scores` with huggingface_hub's `parameters` (its text_classification's): `top_k` kept, and
    `function_to_apply` "none" as the logits; "softmax" or "sigmoid" are refused, fleetbox scoring as the model's
    config says (a choice of squash is not one the classify path has)."""
    parameters = tei.parameters
    if parameters is None:
        return None, tei.raw_scores
    chosen = parameters.function_to_apply
    if chosen not in (None, "none"):
        raise Unprocessable(
            f"parameters.function_to_apply {chosen!r}: fleetbox scores as the model's config says (a softmax over "
            'the labels, a sigmoid per label for multi-label models); "none" gives the logits, or leave it out',
            code="unsupported_parameter",
        )
    return parameters.top_k, tei.raw_scores or chosen == "none"


def _predict_inputs(inputs: str | list[str | list[str]]) -> tuple[list[str], bool]:
    """TEI's `inputs` as (texts, whether a batch): a string or a one-string list is one input, a list of one-string
    lists a batch; a two-string list, alone or in a batch, is a sentence pair, which fleetbox's classifiers do not
    take."""
    pair = Unprocessable(
        "`inputs` holds a sentence pair; fleetbox classifies single texts only (a cross-encoder's pairs go to "
        "/rerank): send a string, or a batch of one-string lists",
        code="unsupported_parameter",
    )
    if isinstance(inputs, str):
        return [inputs], False
    if all(isinstance(item, str) for item in inputs):
        if len(inputs) == 2:
            raise pair
        if len(inputs) > 2:
            raise Unprocessable("`inputs`: a list of strings is one text (or TEI's pair); a batch is a list of lists")
        return inputs, False  # type: ignore[return-value]
    if not all(isinstance(item, list) for item in inputs):
        raise Unprocessable("`inputs` mixes strings and lists; a batch is a list of one-string lists")
    texts = []
    for index, item in enumerate(inputs):
        if len(item) == 2:
            raise pair
        if len(item) != 1:
            raise Unprocessable(f"`inputs` {index} holds {len(item)} strings; each input of a batch is one string")
        texts.append(item[0])
    return texts, True


# A TEI server serves its one model's route at `POST /` too (and at SageMaker's `/invocations`).
_TEI_ROUTE = {Task.EMBED: embed_tei, Task.CLASSIFY: predict_tei, Task.SCORE: rerank_at_root}


async def tei_root(request: web.Request, served: str | None = None) -> web.StreamResponse:
    """TEI's `POST /` and `/invocations`: the TEI route of the model's task (`/embed`, `/predict` or `/rerank`), of
    the model the URL serves (`served`: `/tei/{name}`), else the model named, else the fleet's one encoder model of
    those tasks. huggingface_hub's `InferenceClient` with a TEI URL posts its `feature_extraction` and
    `text_classification` here."""
    ctx = GatewayContext.of(request)
    body = await read_body(request, ctx.settings)
    shape = decode(body, _decoders[TeiShape])
    if shape.query is not None:
        return await rerank_at_root(request, body, served)
    if shape.model is not None and not isinstance(shape.model, str):  # it was told `model` was missing
        raise Unprocessable(f"`model` must be a model's name, a string, not {orjson.dumps(shape.model).decode()[:40]}")
    named = shape.model or None
    if served is not None or named is not None:
        task = ctx.catalog.resolve(served or named, None).spec.task  # type: ignore[arg-type]
    else:
        tasks = {spec.task for spec in ctx.catalog if spec.task in _TEI_ROUTE and spec.adapter_of is None}
        if len(tasks) != 1:
            kinds = (
                " and ".join(sorted(_KIND[task] + "s" for task in tasks))
                or "no embedding model, classifier or reranker"
            )
            raise Unprocessable(
                f"POST / stands for a TEI server's one model's route, and this fleet has {kinds}: name the model, "
                "POST to /embed, /predict or /rerank, or use the model's own TEI URL, /tei/NAME",
                code="model_required",
            )
        (task,) = tasks
    handler = _TEI_ROUTE.get(task)
    if handler is None:
        raise Unprocessable(
            f"POST {request.path} serves embedding, classification and rerank models as TEI does; this one serves "
            f"{task}: send it to {ROUTE_FOR[task]}",
            code="wrong_task",
        )
    return await handler(request, body, served)


def tei_model(ctx: GatewayContext, route: str) -> ModelSpec:
    """The model a TEI route without a model (`GET /info`) stands for: the fleet's one embedding, classification
    or rerank model, as `POST /` picks it; else a 422 naming them."""
    specs = [spec for spec in ctx.catalog if spec.task in _TEI_ROUTE and spec.adapter_of is None]
    if len(specs) == 1:
        return specs[0]
    names = f": {', '.join(spec.name for spec in specs)}" if specs else ""
    raise Unprocessable(
        f"{route} stands for a TEI server's one model, and this fleet has {len(specs)} embedding, classification "
        f"and rerank models{names}: ask a model's own TEI URL, /tei/NAME (e.g. GET /tei/NAME/info)",
        code="model_required",
    )


async def classify(request: web.Request) -> web.Response:
    return await _per_input(request, ClassifyRequest, Task.CLASSIFY)


async def extract(request: web.Request) -> web.Response:
    return await _per_input(request, ExtractRequest, Task.EXTRACT)


async def _per_input(request: web.Request, schema: type, task: Task) -> web.Response:
    """Classify and extract: the worker's JSON (one list per input) passes through unparsed."""
    _, resolved, meta, body = await _enqueue(request, schema, task)
    payload = {
        "object": task.value,
        "model": resolved.name,
        "data": orjson.Fragment(body),
        "usage": _usage(meta),
    }
    return json_response(payload, headers=_timing(meta))
