"""OpenAI `POST /v1/completions` and `/v1/chat/completions`, whole or streamed as server-sent events.

The worker streams numbered text chunks; this module only shapes them: into one response, or
into OpenAI's chunk objects on the wire as they arrive, ending with `data: [DONE]`. The chunks are
OpenAI's to the field, since stock clients read them so: the first chat delta carries the role and
`content` (empty when it has no text), and with `include_usage` every chunk carries `usage`, null
but in the last. An error before the first chunk is an ordinary HTTP error; one after it is an SSE
`error` event, then `[DONE]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
import orjson
from aiohttp import web

from appliance.errors import FleetboxError, InternalError, ServiceUnavailable, Unprocessable
from appliance.gateway.context import CLIENT_GONE, REQUEST_ID, GatewayContext, request_id_headers
from appliance.gateway.encoders import ROUTE_FOR
from appliance.gateway.http import decode, json_response, read_body, request_priority, request_timeout
from appliance.gateway.replies import Reply
from appliance.generation_schemas import ChatRequest, CompletionRequest
from runtimes.base import Task

log = logging.getLogger(__name__)

_decoders = {ChatRequest: msgspec.json.Decoder(ChatRequest), CompletionRequest: msgspec.json.Decoder(CompletionRequest)}


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionRequest)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatRequest)


async def _generate(request: web.Request, schema: type[ChatRequest] | type[CompletionRequest]) -> web.StreamResponse:
    ctx = GatewayContext.of(request)
    body = await read_body(request, ctx.settings)
    parsed = decode(body, _decoders[schema])
    if isinstance(parsed, CompletionRequest) and parsed.token_ids():
        raise Unprocessable(
            "`prompt` holds token ids; fleetbox tokenises the prompt with the model's own tokenizer: send its text",
            code="unsupported_parameter",
        )
    refused = parsed.refused()
    if refused:
        several = "; for several choices, send several requests" if {"n", "best_of"} & set(refused) else ""
        raise Unprocessable(
            f"{', '.join(refused)}: not supported by this server (fleetbox generates one choice of plain text, "
            "without tools, structured output, log probabilities, audio, web search, "
            "moderation, a chat template of the request's own, or vLLM's guided decoding and token controls); "
            f"leave them out{several}",
            code="unsupported_parameter",
        )
    conflict = parsed.conflict()
    if conflict:
        raise Unprocessable(conflict)
    resolved = ctx.catalog.resolve(parsed.model, parsed.adapter)
    if resolved.spec.task is not Task.GENERATE:
        raise Unprocessable(
            f"model {resolved.name} serves {resolved.spec.task}, not text generation; "
            f"send it to {ROUTE_FOR[resolved.spec.task]}",
            code="wrong_task",
        )
    chat = schema is ChatRequest
    # Admission weighs the most a generation may make: no more than the model's context, where a box holding it
    # says (`max_tokens` of 100,000 on a 128-token model was weighed whole: 48 of a burst of 80 refused 429
    # with Retry-After 60 for answers made in a second, black-box finding). Before any box has loaded it, as sent.
    context = ctx.model_state(resolved.spec.name)["max_model_len"]
    new_tokens = parsed.new_tokens() if context is None else min(parsed.new_tokens(), context)
    ctx.refuse_without_workers()
    timeout_s = request_timeout(request, parsed.timeout, ctx.settings, generation=True)
    deadline = time.monotonic() + timeout_s

    def generate(request_id: str | None) -> AsyncIterator[Reply]:
        return ctx.dispatcher.stream(
            spec=resolved.spec,
            task=Task.GENERATE.value,
            body=body,
            timeout_s=deadline - time.monotonic(),
            tokens=len(body) // 4,
            new_tokens=new_tokens,
            adapter=resolved.adapter,
            priority=request_priority(request),
            request_id=request_id,
            asked_timeout_s=timeout_s,  # a 504 names it, not what was left (tester h142: "deadline of 29.998s")
        )

    include_usage = bool(parsed.stream and parsed.stream_options and parsed.stream_options.include_usage)
    shape = _Shape(chat=chat, model=resolved.name, request_id=request[REQUEST_ID], include_usage=include_usage)
    if parsed.stream:
        async with aclosing(generate(request[REQUEST_ID])) as chunks:
            return await _stream(request, chunks, shape)
    try:
        async with aclosing(generate(request[REQUEST_ID])) as chunks:
            return await _whole(chunks, shape)
    except FleetboxError as error:
        # A chunk lost in transit that its box could not make again (it had finished: tester h86, a NATS restart):
        # nothing has reached this client yet, so the answer is made again, once, under a new id.
        if error.code != "chunk_lost" or deadline - time.monotonic() <= 0:
            raise
    again = ctx.new_request_id()
    log.info("generation published again: a chunk was lost", extra={"request_id": request[REQUEST_ID], "as": again})
    async with aclosing(generate(again)) as chunks:
        return await _whole(chunks, shape)


class _Shape:
    """Builds OpenAI's objects for one request: ids, timestamps and the choice layout."""

    def __init__(self, chat: bool, model: str, request_id: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        # The request id (a NUID: unique across gateways, where a clock's nanoseconds were not: tester h200), so the
        # id a client logs finds the box's log lines.
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def whole(self, text: str, finish_reason: str | None, usage: dict[str, int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            # As OpenAI's: the first delta has `content` even with no text yet ("": clients read it as a string),
            # a later one only when it has text (the last one's may be {}).
            if first:
                choice["delta"] = {"role": "assistant", "content": text or ""}
            else:
                choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text or ""
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's: every chunk but the usage one says it has none
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }


def _usage(body: dict[str, Any]) -> dict[str, int]:
    usage = body.get("usage") or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _whole(chunks: AsyncIterator[Reply], shape: _Shape) -> web.Response:
    parts: list[str] = []
    async for chunk in chunks:
        if chunk.restarted:
            parts.clear()  # another box answers from the start: what the first one sent is dropped
        if chunk.meta.status != 200:
            raise chunk.failure()
        body = orjson.loads(chunk.body)
        parts.append(body.get("text", ""))
        if chunk.meta.final:
            return json_response(shape.whole("".join(parts), body.get("finish_reason"), _usage(body)))
    raise InternalError("the generation ended without its final chunk")  # Dispatcher.stream ends on one, or raises


async def _stream(request: web.Request, chunks: AsyncIterator[Reply], shape: _Shape) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    first = True
    resume = _Resume()
    try:
        try:
            async for chunk in chunks:
                if chunk.restarted:
                    resume.restart()
                if chunk.meta.status != 200:
                    raise chunk.failure()
                if response is None:
                    response = _event_stream(request)
                    await response.prepare(request)
                body = orjson.loads(chunk.body)
                text = resume.new_text(body.get("text") or "")
                if text is None and not chunk.meta.final:
                    continue  # the new box is still catching up with what the client has already seen
                finish = body.get("finish_reason") if chunk.meta.final else None
                await _event(response, shape.chunk(text, finish, first=first))
                first = False
                if chunk.meta.final and shape.include_usage:
                    await _event(response, shape.usage_chunk(_usage(body)))
        except FleetboxError as error:
            if response is None:
                raise  # nothing sent yet: an ordinary HTTP error
            # Counted and logged: the request's own line says 200, sent before the error (tester h85).
            GatewayContext.of(request).metrics.stream_errors.labels(shape.model, error.code).inc()
            log.info("stream ended with an error", extra={"request_id": request[REQUEST_ID], "error": error.message})
            await _event(response, error.body())
        if response is None:
            response = _event_stream(request)
            await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # aiohttp's "Cannot write to closing transport": a client gone mid-stream
        if response is None:
            raise
        # Not a server error (it was a logged traceback and a 500 in the metrics: tester h70); the generation
        # stops as the caller closes `chunks`.
        request[CLIENT_GONE] = True
    return response


def _event_stream(request: web.Request) -> web.StreamResponse:
    """The event stream's response, to be prepared (its headers sent) once it is kept: a client gone as they go is
    a 499 like one gone later (raised while `_stream` had no response, it was a 500 and a traceback, 43 of 80
    streams dropped at once: tester h224)."""
    headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    return web.StreamResponse(headers=headers | request_id_headers(request))


class _Resume:
    """Carries a streamed answer over to a box that starts it again after the first one stopped.

    The client already has some text. A greedy or seeded generation comes out the same on the new
    box, so its chunks are held back until they have caught up with that text, and only the rest
    is sent on: the client sees one unbroken answer. A new answer that differs from what was sent
    (sampling without a seed) cannot be stitched on: the stream ends with an error event.
    """

    def __init__(self) -> None:
        self.sent = ""  # the text the client has
        self.replay: str | None = None  # the new box's text while it catches up; None when not resuming

    def restart(self) -> None:
        self.replay = ""

    def new_text(self, text: str) -> str | None:
        """What of this chunk's text to send on, None for nothing yet; raises when the answers diverge."""
        if self.replay is not None:
            self.replay += text
            if not (self.sent.startswith(self.replay) or self.replay.startswith(self.sent)):
                raise ServiceUnavailable(
                    "the box generating this answer stopped mid-answer, and the box that took it over "
                    "generated a different text (sampling without a seed); send the request again",
                    code="generation_restarted",
                )
            if len(self.replay) <= len(self.sent):
                return None
            text, self.replay = self.replay[len(self.sent) :], None
        self.sent += text
        return text or None


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")
