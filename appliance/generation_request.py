"""What a generation request asks of the runtime: its prompt as token ids, and its sampling parameters.

A request is a chat (it has `messages`) or a completion, decoded with one schema error either way;
a chat reaches the model's template as vLLM hands it over (content parts joined by newlines, `null`
content as "", the history's tool calls with their JSON arguments parsed, a tool turn's call id, and
vLLM's template controls), so a template renders what it would under vLLM;
a prompt that does not fit the model is a 413 named as the client knows it (the conversation or the
prompt, not "input 0"); a conversation the model's chat template refuses is a 400 at once, not a
model failure retried and dead-lettered; and what a request leaves out of its sampling is the model's
own default from generation_config.json, as vLLM does.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from appliance.errors import BadRequest, PayloadTooLarge, Unprocessable
from appliance.generation_schemas import ChatMessage, ChatRequest, CompletionRequest, ToolCall
from runtimes import InputTooLong, UnsupportedModel
from runtimes.generate import (
    ChatTemplateError,
    GenerateRuntime,
    ReservedTemplateVariable,
    SamplingParams,
    TemplateControls,
)

_chat = msgspec.json.Decoder(ChatRequest)
_completion = msgspec.json.Decoder(CompletionRequest)


class _Conversation(msgspec.Struct):
    """Only whether a body has a top-level `messages` (the rest skipped unparsed): the bytes `"messages"` anywhere
    made a chat of a completion whose `user` was "messages", then refused it for its missing conversation."""

    messages: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty when the body has none


_conversation = msgspec.json.Decoder(_Conversation)


def decode_generation(body: bytes) -> ChatRequest | CompletionRequest:
    """Chat when the body has `messages` (a completion's is refused at the gateway), a completion otherwise; one
    schema error either way."""
    try:
        decoder = _chat if bytes(_conversation.decode(body).messages) not in (b"", b"null") else _completion
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise Unprocessable(f"invalid generation request: {exc}") from None


def prompt_ids(runtime: GenerateRuntime, request: ChatRequest | CompletionRequest) -> Any:
    """The prompt's token ids: the chat rendered with the model's template, or the completion's text."""
    truncate, keep = request.prompt_cut()
    try:
        if isinstance(request, ChatRequest):
            controls = TemplateControls(
                add_generation_prompt=bool(request.add_generation_prompt),
                continue_final_message=bool(request.continue_final_message),
                variables=request.chat_template_kwargs or {},
            )
            messages = [template_message(m) for m in request.messages]
            ids = runtime.apply_chat_template(messages, truncate=truncate, controls=controls)
        else:
            ids = runtime.tokenize([request.text()], truncate=truncate)[0].ids
        if len(ids) == 0:  # told of token ids it never sent (tester h185)
            raise Unprocessable(f"{_prompt_named(request)} is empty: it has no token to generate from; send some text")
        return ids if keep is None else ids[-keep:]
    except InputTooLong as exc:  # named as the client knows it: there is no "input 0" in a chat
        message = str(InputTooLong(exc.index, exc.max_length, what=_prompt_named(request)))
        raise PayloadTooLarge(message, code="input_too_long") from None
    except UnsupportedModel as exc:
        raise Unprocessable(str(exc), code="no_chat_template") from None
    except ReservedTemplateVariable as exc:
        names = ", ".join(f"`{name}`" for name in exc.names)
        raise Unprocessable(
            f"chat_template_kwargs: {names} would set an argument of the chat template call itself, "
            "not a template variable; use the request's own fields (add_generation_prompt, continue_final_message)"
            " or leave them out"
        ) from None
    except ChatTemplateError as exc:  # answered at once: a retry renders the same conversation the same way
        if exc.broken:
            raise Unprocessable(
                f"the model's chat template cannot be used: {exc}", code="invalid_chat_template"
            ) from None
        raise BadRequest(
            f"the model's chat template failed on this conversation: {exc}", code="chat_template_error"
        ) from None


def _prompt_named(request: ChatRequest | CompletionRequest) -> str:
    """The prompt as the client knows it, for an error's message."""
    if isinstance(request, ChatRequest):
        return "the conversation, rendered with the model's chat template,"
    return "the prompt"


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as vLLM hands it to a chat template (its `parse_chat_messages`, for text-only models)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        rendered["name"] = message.name
    if message.tool_calls:  # an empty list is left out, as vLLM does: the template takes its plain path
        rendered["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _tool_call(call: ToolCall) -> dict[str, Any]:
    """transformers' tool-use templates read the arguments as an object (`arguments | items`), so JSON ones are
    parsed, as vLLM does; others are kept as sent rather than replaced."""
    try:
        arguments = orjson.loads(call.function.arguments)
    except orjson.JSONDecodeError:
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def sampling_params(runtime: GenerateRuntime, request: ChatRequest | CompletionRequest) -> SamplingParams:
    """What the request asks of the sampler; what it leaves out, the model's own defaults."""
    defaults = runtime.defaults
    return SamplingParams(
        max_tokens=request.new_tokens(),
        # Not given: the model's generation_config.json value (as vLLM does), else none.
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else max(0, request.top_k),
        min_p=defaults.min_p if request.min_p is None else request.min_p,
        repetition_penalty=defaults.repetition_penalty
        if request.repetition_penalty is None
        else request.repetition_penalty,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=request.token_bias(),
        stop=request.stops(),
        seed=request.seed,
    )
