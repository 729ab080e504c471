"""Request bodies of the generation routes (`/v1/completions`, `/v1/chat/completions`), OpenAI's shapes.

Validated by msgspec as the encoder routes' bodies are (`appliance/schemas.py`): a bad body is a 4xx at the
gateway, and the worker decodes the same bytes with the same schema.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from appliance.schemas import NonEmptyText, NullIsDefault, Positive, Timeout

# What torch's generators take: a signed 64-bit integer.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1, description="a signed 64-bit integer")]


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # OpenAI's: the arguments as a JSON string


class ToolCall(msgspec.Struct, kw_only=True):
    """A tool call an assistant turn of the history made: kept for the template, never made by fleetbox."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # OpenAI's content parts: text only (these are text models). `null`, or left out: an assistant turn of tool calls
    # (the openai SDK and vLLM send one so; left out of another role's message, it is refused as OpenAI does).
    content: str | Annotated[list[TextPart], msgspec.Meta(min_length=1)] | msgspec.UnsetType | None = msgspec.UNSET
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers

    def __post_init__(self) -> None:
        # Refused, as OpenAI refuses them, rather than passed to a template that would show them in another turn.
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed in an assistant message, not a {self.role} one")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed in a tool message, not a {self.role} one")
        if self.tool_call_id is None and self.role == "tool":  # the call it answers: OpenAI's 400 too (tester h81)
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is msgspec.UNSET or self.content is None:
            if self.role != "assistant":  # null too, as OpenAI refuses it (h86: answered 200, read as "")
                raise ValueError(f"a {self.role} message needs its content")
            self.content = None

    def text(self) -> str:
        """The content as one string: parts joined by newlines (as vLLM joins them), `null` as empty."""
        if self.content is None or self.content is msgspec.UNSET:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class StreamOptions(NullIsDefault, kw_only=True):
    include_usage: bool | None = False


Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
# OpenAI's bias range; a key is a token id as a string ("50256").
# Token ids as OpenAI writes them: no leading zeros, so no two keys name one token.
LogitBias = dict[
    Annotated[str, msgspec.Meta(pattern=r"^(0|[1-9][0-9]{0,8})$")], Annotated[float, msgspec.Meta(ge=-100, le=100)]
]


DEFAULT_MAX_TOKENS = 256  # a generation's length limit when the request gives none


class _Sampling(NullIsDefault, kw_only=True):
    _ADDS_SPECIAL_TOKENS: ClassVar[bool] = True  # the prompt's tokens as fleetbox (and vLLM by default) make them

    model: str
    max_tokens: Positive | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None  # None: the model's own default
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)] | None = None  # vLLM's: -1 or 0 is every token
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=10)] | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: LogitBias | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=4)] | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Positive | None = 1  # above 1: refused (`refused`), as the other features fleetbox does not implement
    user: str | None = None
    truncate: bool | None = False
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds, as `truncate`); it was ignored (h62)
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    adapter: str | None = None
    timeout: Timeout | None = None
    # OpenAI fields fleetbox does not implement: accepted at their "off" value only (`refused`).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions that change the answer, not implemented: accepted when absent or off (`refused`).
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    logits_processors: list[Any] | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool | None = None  # off its route's default (true for a completion, false for a chat)

    def new_tokens(self) -> int:
        """The most tokens the answer may have: `max_tokens`, else `DEFAULT_MAX_TOKENS`."""
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items())

    def conflict(self) -> str | None:
        """Why fields that are each valid cannot go together, or None."""
        if self.stream_options is not None and not self.stream:
            return 'stream_options is only allowed with "stream": true'
        if self.truncate_prompt_tokens == 0:
            return "truncate_prompt_tokens must be -1 (as many as the context holds) or at least 1"
        if self.response_format is not None and "type" not in self.response_format:
            return '`response_format` needs its `type` ("text"; OpenAI refuses it without one too)'
        return None

    def prompt_cut(self) -> tuple[bool, int | None]:
        """Whether a prompt longer than the context is cut (from the left) rather than refused, and the most of its
        last tokens it keeps (`truncate_prompt_tokens`), if it says."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return bool(self.truncate), None
        return True, (keep if keep > 0 else None)

    def refused(self) -> list[str]:
        """The fields asking for what fleetbox does not do (tools, structured output, logprobs, ...): a 422 each,
        since answering without them would change what the answer means. Their "off" values pass: the openai
        SDK and other clients send them."""
        asked = {
            "tools": bool(self.tools),
            "functions": bool(self.functions),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "function_call": self.function_call not in (None, "none", "auto"),
            "response_format": (self.response_format or {}).get("type", "text") != "text",
            "n": self.n != 1,
            "ignore_eos": bool(self.ignore_eos),
            "min_tokens": bool(self.min_tokens),
            "stop_token_ids": bool(self.stop_token_ids),
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "skip_special_tokens": self.skip_special_tokens is False,
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "use_beam_search": bool(self.use_beam_search),
            "return_tokens_as_token_ids": bool(self.return_tokens_as_token_ids),
            "return_token_ids": bool(self.return_token_ids),
            "logits_processors": bool(self.logits_processors),
            "prompt_embeds": self.prompt_embeds is not None,
            "add_special_tokens": self.add_special_tokens not in (None, self._ADDS_SPECIAL_TOKENS),
        }
        guided = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
        asked |= {name: getattr(self, name) is not None for name in guided}
        return [name for name, on in asked.items() if on]


class CompletionRequest(_Sampling, kw_only=True):
    """OpenAI `POST /v1/completions` (one prompt, one choice)."""

    # One prompt: a string, or a list of one. Token ids (a list of integers, or of such lists), OpenAI's and vLLM's
    # other forms, are read only to be refused by name (the gateway's `_generate`): they were a schema error.
    prompt: NonEmptyText | Annotated[list[Any], msgspec.Meta(min_length=1)]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Positive | None = None  # at least 1 (OpenAI's range; 0 was told it was unsupported, tester h185)
    messages: list[Any] | None = None  # a chat's: refused, as OpenAI refuses it (the box rendered a chat)

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def token_ids(self) -> bool:
        """Whether the prompt is token ids: integers, or lists of them."""
        if not isinstance(self.prompt, list):
            return False
        items = self.prompt[0] if isinstance(self.prompt[0], list) and len(self.prompt) == 1 else self.prompt
        return bool(items) and all(isinstance(item, int) and not isinstance(item, bool) for item in items)

    def conflict(self) -> str | None:
        one = isinstance(self.prompt, str) or (len(self.prompt) == 1 and isinstance(self.prompt[0], str))
        if not one and not self.token_ids():
            return "`prompt` must be a string, or a list of exactly one string (one prompt a request)"
        if not isinstance(self.prompt, str) and one and not self.prompt[0]:
            return "`prompt` 0 is an empty string"
        return super().conflict()

    def refused(self) -> list[str]:
        asked = {"logprobs": self.logprobs is not None, "echo": bool(self.echo), "suffix": bool(self.suffix)}
        asked["messages"] = self.messages is not None
        asked["best_of"] = self.best_of not in (None, 1)
        return super().refused() + [name for name, on in asked.items() if on]


class ChatRequest(_Sampling, kw_only=True):
    """OpenAI `POST /v1/chat/completions` (one choice), rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1 is vLLM's "the whole vocabulary"
    # Chat-only OpenAI features fleetbox does not implement: accepted when absent or null (and text-only
    # `modalities`), refused otherwise; answering without them would not be what the client asked for.
    modalities: list[str] | None = None  # ["text", "audio"]: an audio answer
    audio: dict[str, Any] | None = None  # the voice and format of that audio answer
    web_search_options: dict[str, Any] | None = None  # even {}: an answer grounded in a web search
    # A moderation model screening (or blocking) input and output: any value but null is refused by name, `true` too
    # (tester h96: typed as an object, `true` was an invalid_input where the docs say unsupported_parameter).
    moderation: Any = None
    # vLLM's chat-template controls, handed to the model's template as vLLM hands them.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template, e.g. {"enable_thinking": false}
    # vLLM's, refused: a template of the client's own (vLLM too, unless its server trusts them), and echo.
    chat_template: str | None = None
    echo: bool | None = False
    documents: list[Any] | None = None  # vLLM's: documents for a RAG template; not handed over, so refused

    _ADDS_SPECIAL_TOKENS: ClassVar[bool] = False  # the template writes them

    def conflict(self) -> str | None:
        if self.add_generation_prompt and self.continue_final_message:
            return (
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                "(add_generation_prompt defaults to true: send it as false to continue the final message)"
            )
        return super().conflict()

    def refused(self) -> list[str]:
        asked = {
            "chat_template": self.chat_template is not None,
            "echo": bool(self.echo),
            "logprobs": bool(self.logprobs),
            "top_logprobs": bool(self.top_logprobs),
            "modalities": self.modalities is not None and set(self.modalities) != {"text"},
            "audio": self.audio is not None,
            "web_search_options": self.web_search_options is not None,
            "moderation": self.moderation is not None,
            "documents": bool(self.documents),
        }
        return super().refused() + [name for name, on in asked.items() if on]

    def new_tokens(self) -> int:
        """`max_completion_tokens` (OpenAI's newer name) over `max_tokens`, else `DEFAULT_MAX_TOKENS`."""
        return self.max_completion_tokens or super().new_tokens()
