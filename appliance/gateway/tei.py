"""TEI's API family: `/embed`, `/predict`, `/rerank`, `/similarity` and `POST /` (with SageMaker's `/invocations`).

A TEI request is queued as the fleetbox request it stands for (one worker path per task: `encoders.enqueue`), its
`model` left out meaning the fleet's one model of the task, as a TEI server serves one; its answer is TEI's bare
list, shaped from the same compact reply the fleetbox route reads.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import orjson
from aiohttp import web

from appliance.catalog import ModelSpec
from appliance.envelope import ReplyMeta
from appliance.errors import PayloadTooLarge, Unprocessable
from appliance.gateway.context import GatewayContext
from appliance.gateway.encoders import (
    MODEL_KIND,
    ROUTE_FOR,
    enqueue,
    refuse_token_ids,
    rerank,
    the_one_model,
    timing,
)
from appliance.gateway.http import decode, json_response, read_body
from appliance.schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    RerankShape,
    SimilarityParameters,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiRequest,
    TeiRerankRequest,
    TeiShape,
    TeiSimilarityRequest,
)
from runtimes import InputTooLong, Task
from runtimes.tasks.score import sigmoid

_decoders: dict[type, msgspec.json.Decoder] = {
    schema: msgspec.json.Decoder(schema)
    for schema in (TeiRerankRequest, TeiEmbedRequest, TeiPredictRequest, TeiSimilarityRequest, TeiShape, RerankShape)
}


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
            # Named by the path the client called (a classification client's `inputs` at `/tei/{name}` of a reranker
            # was told of `/tei/{name}/rerank`, a path it never called: tester h96).
            raise Unprocessable(f"{request.path} takes TEI's rerank: a `query`, and the documents as `texts`")
        return await rerank(request, body, infinity=True)
    tei = decode(body, _decoders[TeiRerankRequest])
    meta, reply = await _enqueue_tei(
        request,
        tei,
        RerankRequest,
        Task.SCORE,
        served,
        "texts",
        query=tei.query,
        documents=tei.texts,
        raw_scores=True,
    )
    # TEI squashes a one-logit score by the sigmoid unless `raw_scores`, whatever activation the model's config names
    # (`/v1/rerank` applies that one, as sentence-transformers does): a TEI client's threshold keeps its meaning.
    logits = np.frombuffer(reply, dtype="<f4")
    scores = logits if tei.raw_scores else sigmoid(logits)
    results = []
    for index in np.argsort(-scores, kind="stable").tolist():
        result: dict[str, Any] = {"index": index, "score": float(scores[index])}
        if tei.return_text:
            result["text"] = tei.texts[index]
        results.append(result)
    return json_response(results, headers=timing(meta))


async def _enqueue_tei(
    request: web.Request, tei: TeiRequest, schema: type, task: Task, served: str | None, field: str, **fields: Any
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
    model = served or tei.model or the_one_model(ctx, task)
    body = {"model": model, "truncate": tei.truncate, "adapter": tei.adapter, "timeout": tei.timeout, **fields}
    _, _, meta, reply = await enqueue(request, schema, task, orjson.dumps(body), field=field)
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
    refuse_token_ids(texts, "`inputs` holds token ids; fleetbox tokenises text with the model's own tokenizer")
    _refuse_prompt(tei.prompt_name)
    meta, reply = await _enqueue_tei(
        request,
        tei,
        EmbeddingRequest,
        Task.EMBED,
        served,
        "inputs",
        input=texts,
        dimensions=tei.dimensions,
        normalize=tei.normalize,
    )
    return json_response(np.frombuffer(reply, dtype="<f4").reshape(meta.rows, meta.dims), headers=timing(meta))


async def similarity_tei(request: web.Request, body: bytes | None = None, served: str | None = None) -> web.Response:
    """TEI's `/similarity` (huggingface_hub's `sentence_similarity`): the cosine similarity of `source_sentence` to
    each of `sentences`, a bare list in their order, from the vectors `/v1/embeddings` computes for them (one request,
    so one batch). `parameters` may carry the truncation and the prompt, as TEI reads them."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    tei = decode(body, _decoders[TeiSimilarityRequest])
    parameters = tei.parameters or SimilarityParameters()
    _refuse_prompt(tei.prompt_name or parameters.prompt_name)
    if parameters.truncate is not None:
        tei = msgspec.structs.replace(tei, truncate=parameters.truncate)
    if parameters.truncation_direction is not None:
        tei = msgspec.structs.replace(tei, truncation_direction=parameters.truncation_direction)
    texts = [tei.inputs.source_sentence, *tei.inputs.sentences]
    limit = GatewayContext.of(request).settings.max_inputs
    if len(texts) > limit:  # said of the sentences the client sent, not of the inputs they are queued as
        raise PayloadTooLarge(
            f"{len(tei.inputs.sentences)} sentences is more than the limit of {limit - 1} (the source sentence is one "
            f"of the {limit} inputs a request may hold)",
            code="too_many_inputs",
        )
    try:
        meta, reply = await _enqueue_tei(
            request, tei, EmbeddingRequest, Task.EMBED, served, "sentences", input=texts, normalize=True
        )
    except PayloadTooLarge as exc:
        raise _named_as_sent(exc) from None
    vectors = np.frombuffer(reply, dtype="<f4").reshape(meta.rows, meta.dims)
    return json_response(vectors[1:] @ vectors[0], headers=timing(meta))


def _named_as_sent(error: PayloadTooLarge) -> PayloadTooLarge:
    """A worker's over-long-input 413 names the inputs as queued (input 0 is the source sentence); the client sent
    `source_sentence` and `sentences[i]` (tester h96)."""
    index = InputTooLong.index_in(error.message)
    if error.code != "input_too_long" or index is None:
        return error
    what = "source_sentence" if index == 0 else f"sentences[{index - 1}]"
    message = error.message.replace(f"input {index}", what, 1)
    return PayloadTooLarge(message, code=error.code, headers=error.headers)


def _refuse_prompt(prompt_name: str | None) -> None:
    if prompt_name is not None:
        raise Unprocessable(
            f"`prompt_name` ({prompt_name!r}): fleetbox applies no sentence-transformers prompts; "
            "prepend the prompt's text to each input instead",
            code="unsupported_parameter",
        )


async def predict_tei(request: web.Request, body: bytes | None = None, served: str | None = None) -> web.Response:
    """TEI's `/predict`: labels with scores, best first, as `/v1/classify` gives them; for one input its list, for a
    batch one list per input."""
    if body is None:
        body = await read_body(request, GatewayContext.of(request).settings)
    tei = decode(body, _decoders[TeiPredictRequest])
    texts, batch = _predict_inputs(tei.inputs)
    meta, reply = await _enqueue_tei(
        request, tei, ClassifyRequest, Task.CLASSIFY, served, "inputs", input=texts, **_predict_parameters(tei)
    )
    return json_response(orjson.Fragment(reply) if batch else orjson.loads(reply)[0], headers=timing(meta))


def _predict_parameters(tei: TeiPredictRequest) -> dict[str, Any]:
    """`top_k`, `raw_scores` and `function_to_apply` from huggingface_hub's `parameters` (its text_classification's),
    as fleetbox's classify request takes them."""
    parameters = tei.parameters
    if parameters is None:
        return {"top_k": None, "raw_scores": tei.raw_scores}
    chosen = parameters.function_to_apply
    if tei.raw_scores and chosen in ("softmax", "sigmoid"):  # named as this route takes it (review h141)
        raise Unprocessable(
            f"`raw_scores` asks for the logits and `parameters.function_to_apply` {chosen!r} for the {chosen} of "
            "them; send one of the two",
            code="invalid_input",
        )
    return {
        "top_k": parameters.top_k,
        # "none" as `raw_scores` as well: a box of a version without `function_to_apply` ignores the field
        # (a fleet being upgraded answers with both), and would answer probabilities for the logits asked for.
        "raw_scores": tei.raw_scores or chosen == "none",
        "function_to_apply": chosen,
    }


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
    those tasks; `inputs` that are an object (`source_sentence`, `sentences`) are a `/similarity`, of the fleet's one
    embedding model if none is named. huggingface_hub's `InferenceClient` with a TEI URL posts its
    `feature_extraction`, `sentence_similarity` and `text_classification` here."""
    ctx = GatewayContext.of(request)
    body = await read_body(request, ctx.settings)
    shape = decode(body, _decoders[TeiShape])
    if shape.query is not None:
        return await rerank_at_root(request, body, served)
    if bytes(shape.inputs).startswith(b"{"):  # {source_sentence, sentences}: huggingface_hub's sentence_similarity
        return await similarity_tei(request, body, served)
    if shape.model is not None and not isinstance(shape.model, str):  # it was told `model` was missing
        raise Unprocessable(f"`model` must be a model's name, a string, not {orjson.dumps(shape.model).decode()[:40]}")
    named = shape.model or None
    if served is not None or named is not None:
        task = ctx.catalog.resolve(served or named, None).spec.task  # type: ignore[arg-type]
    else:
        tasks = {spec.task for spec in ctx.catalog if spec.task in _TEI_ROUTE and spec.adapter_of is None}
        if len(tasks) != 1:
            kinds = (
                " and ".join(sorted(MODEL_KIND[task] + "s" for task in tasks))
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
