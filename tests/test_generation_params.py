"""OpenAI's generation parameters: each is honoured, or refused with a 422 naming it; none is silently ignored.

What fleetbox does not do (several choices, tools, structured output, log probabilities, audio, web search,
predicted outputs, moderation, echo, suffix, best_of > 1) would change what the answer means if left out, so
asking for it is refused; its "off" value (what the openai SDK and other clients send) passes. The box, the
queue and the tiny generator are real.
"""

from __future__ import annotations

import json

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request
from openai import AsyncOpenAI

from appliance.gateway.http import request_timeout
from appliance.generation_request import decode_generation
from appliance.generation_schemas import DEFAULT_MAX_TOKENS
from appliance.settings import ModelEntry, Settings
from tests.conftest import url

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4}


@pytest.fixture
async def box(start_box, generator_dir):
    model = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True)
    return await start_box(default_model=False, models=[model])


async def post(http, box, route: str, body: dict) -> tuple[int, dict]:
    async with http.post(url(box, route), json=body) as response:
        return response.status, await response.json()


@pytest.mark.parametrize(
    ("route", "fields", "named"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs, top_logprobs"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"logprobs": 3}, "logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "."}, "suffix"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        # These three were answered 200 with plain text, as if asked for nothing else.
        ("/v1/chat/completions", {"modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, "modalities, audio"),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
        ("/v1/chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ("/v1/chat/completions", {"moderation": True}, "moderation"),
        # n was a 422 invalid_input ("Expected `int` <= 1"), unlike every other refusal here.
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/completions", {"n": 3, "best_of": 3}, "n, best_of"),
        # vLLM's extensions were answered 200 with the same text as without them.
        ("/v1/completions", {"ignore_eos": True, "min_tokens": 50}, "ignore_eos, min_tokens"),
        ("/v1/completions", {"stop_token_ids": [2], "include_stop_str_in_output": True}, "stop_token_ids, include"),
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "guided_choice"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
        ("/v1/completions", {"skip_special_tokens": False, "use_beam_search": True}, "skip_special_tokens, use_beam"),
        # vLLM's chat fields, answered 200 as if not sent: a template of the client's own, and echo.
        ("/v1/chat/completions", {"chat_template": "{{ messages }}", "echo": True}, "chat_template, echo"),
        # vLLM's extensions found ignored (h62's review of the rest): the answer's form, the prompt's tokens.
        ("/v1/completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
        ("/v1/chat/completions", {"add_special_tokens": True}, "add_special_tokens"),
        ("/v1/chat/completions", {"documents": [{"title": "t", "text": "x"}]}, "documents"),
        ("/v1/completions", {"logits_processors": ["x"], "prompt_embeds": "AAAA"}, "logits_processors, prompt_embeds"),
        # A chat's conversation on the completions route: the box rendered it as a chat, under a completion's shape.
        ("/v1/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ],
)
async def test_a_parameter_fleetbox_does_not_implement_is_refused_by_name(box, http, route, fields, named) -> None:
    status, body = await post(http, box, route, (CHAT if "chat" in route else COMPLETION) | fields)
    assert status == 422, body
    assert body["error"]["code"] == "unsupported_parameter"
    assert body["error"]["message"].startswith(named), body
    assert ": not supported" in body["error"]["message"], body


async def test_vllm_extensions_at_their_off_values_are_answered(box, http) -> None:
    off = {"ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": False}
    off |= {"skip_special_tokens": True, "guided_json": None, "use_beam_search": False}
    off |= {"return_tokens_as_token_ids": False, "return_token_ids": False, "logits_processors": []}
    status, body = await post(http, box, "/v1/completions", COMPLETION | off | {"add_special_tokens": True})
    assert status == 200, body
    status, body = await post(http, box, "/v1/chat/completions", CHAT | off | {"add_special_tokens": False})
    assert status == 200, body


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(box, http) -> None:
    """vLLM's `truncate_prompt_tokens` was taken and ignored (h62): the whole prompt was generated from."""
    long = COMPLETION | {"prompt": "one two three four five six seven eight", "temperature": 0}
    _, whole = await post(http, box, "/v1/completions", long)
    status, cut = await post(http, box, "/v1/completions", long | {"truncate_prompt_tokens": 3})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 3 < whole["usage"]["prompt_tokens"], (cut, whole)
    status, same = await post(http, box, "/v1/completions", long | {"truncate_prompt_tokens": -1})
    assert status == 200 and same["usage"] == whole["usage"], same
    status, body = await post(http, box, "/v1/completions", long | {"truncate_prompt_tokens": 0})
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body


async def test_a_completion_that_names_messages_in_a_value_is_a_completion(box, http) -> None:
    """The box took any body holding the bytes `"messages"` for a chat: this one was refused at the box, 422
    "missing required field `messages`", after the gateway had accepted it."""
    status, body = await post(http, box, "/v1/completions", COMPLETION | {"user": "messages", "stop": ['"messages"']})
    assert status == 200 and body["object"] == "text_completion", body


async def test_stream_options_without_stream_is_refused(box, http) -> None:
    """OpenAI and vLLM answer it 400; it was taken and ignored."""
    status, body = await post(http, box, "/v1/chat/completions", CHAT | {"stream_options": {"include_usage": True}})
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "stream_options is only allowed" in body["error"]["message"]


async def test_the_openai_sdk_sending_every_default_is_answered(box) -> None:
    client = AsyncOpenAI(base_url=url(box, "/v1"), api_key="unused", max_retries=0)
    chat = await client.chat.completions.create(
        **CHAT,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0,
        n=1,
        tool_choice="none",
        response_format={"type": "text"},
        logit_bias={},
        user="someone",
        temperature=0,
        modalities=["text"],
        audio=None,
        prediction={"type": "content", "content": "Hello"},  # a speed-up hint: the answer is the same, ignored
        reasoning_effort="low",  # a hint, ignored
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    completion = await client.completions.create(**COMPLETION, echo=False, best_of=1, logprobs=None, temperature=0)
    assert completion.choices[0].text is not None
    await client.close()


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("/v1/chat/completions", {"n": 0}),
        # Tester h185: these two were told "not supported by this server", of values no server takes.
        ("/v1/completions", {"best_of": 0}),
        ("/v1/chat/completions", {"top_logprobs": -2}),  # -1 is vLLM's whole vocabulary: unsupported_parameter
        ("/v1/chat/completions", {"response_format": {}}),  # was answered 200, as text: OpenAI refuses it
    ],
)
async def test_a_value_out_of_range_is_invalid_input_not_unsupported(box, http, route, fields) -> None:
    status, body = await post(http, box, route, (CHAT if "chat" in route else COMPLETION) | fields)
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body


async def test_the_openai_sdk_sending_null_for_the_chat_only_features_is_answered(box, http) -> None:
    nulls = {"modalities": None, "audio": None, "web_search_options": None, "prediction": None, "moderation": None}
    status, body = await post(http, box, "/v1/chat/completions", CHAT | nulls | {"n": None})
    assert status == 200, body


async def test_logit_bias_and_penalties_change_the_answer(box, http) -> None:
    token = box.workers[MODEL].runtime.tokenize(["a"])[0].ids[-1]
    greedy = COMPLETION | {"temperature": 0, "max_tokens": 6}
    status, body = await post(http, box, "/v1/completions", greedy | {"logit_bias": {str(token): 100}})
    assert status == 200, body
    assert body["choices"][0]["text"] == "a" * 6
    status, plain = await post(http, box, "/v1/completions", greedy | {"logit_bias": {str(token): -100}})
    assert status == 200 and "a" not in plain["choices"][0]["text"], plain
    # Made likeliest by a bias, then divided by the repetition penalty once it has been used: not twice in a row.
    once = greedy | {"logit_bias": {str(token): 8}, "repetition_penalty": 10}
    status, body = await post(http, box, "/v1/completions", once)
    text = body["choices"][0]["text"]
    assert status == 200 and text.startswith("a") and not text.startswith("aa"), body


async def test_a_logit_bias_for_a_token_the_model_does_not_have_is_a_422(box, http) -> None:
    status, body = await post(http, box, "/v1/completions", COMPLETION | {"logit_bias": {"999999": 1}})
    assert status == 422 and "999999" in body["error"]["message"], body


async def test_a_logit_bias_key_with_leading_zeros_is_a_422(box, http) -> None:
    """ "01" and "1" both named token 1, and only one of their biases applied."""
    status, body = await post(http, box, "/v1/completions", COMPLETION | {"logit_bias": {"01": 5, "1": -5}})
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "logit_bias" in body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({**CHAT, "max_tokens": None}, DEFAULT_MAX_TOKENS),
        (CHAT, 4),
        ({**CHAT, "max_completion_tokens": 9}, 9),
        ({**CHAT, "max_tokens": None, "max_completion_tokens": 9}, 9),
        ({**COMPLETION, "max_tokens": None}, DEFAULT_MAX_TOKENS),
        (COMPLETION, 4),
    ],
)
def test_a_generations_length_limit_is_what_the_sampler_and_admission_both_read(body: dict, limit: int) -> None:
    """`new_tokens` is both the sampler's `max_tokens` and the weight admission gives the request."""
    assert decode_generation(orjson.dumps(body)).new_tokens() == limit


@pytest.mark.parametrize(
    ("generation", "headers", "field", "deadline"),
    [
        (False, {}, None, 30.0),
        (True, {}, None, 300.0),  # a generation's covers its whole answer: 30 s cut long ones mid-stream
        (True, {"Timeout": "12"}, None, 12.0),
        (True, {}, 45.0, 45.0),
        (True, {}, 900.0, 300.0),  # capped at max_timeout_s
    ],
)
def test_a_generation_gets_a_deadline_of_its_own_when_it_sets_none(generation, headers, field, deadline) -> None:
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
    assert request_timeout(request, field, Settings(), generation=generation) == deadline


async def test_a_generation_that_waited_for_its_model_to_load_is_counted_as_a_cold_start(
    start_box, http, generator_dir
) -> None:
    """As an encoder's request is (`fbx_cold_start_wait_ms`): a generator's first request never was (black-box)."""
    box = await start_box(default_model=False, models=[ModelEntry(name="cold", path=generator_dir, task="generate")])
    status, body = await post(http, box, "/v1/completions", {**COMPLETION, "model": "cold"})
    assert status == 200, body
    waits = box.metrics.registry.get_sample_value("fbx_cold_start_wait_ms_count", {"model": "cold"})
    assert waits == 1


@pytest.mark.parametrize(
    ("route", "field", "path"),
    [
        ("/v1/chat/completions", "max_tokens", "$.max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens", "$.max_completion_tokens"),
        ("/v1/completions", "max_tokens", "$.max_tokens"),
        ("/v1/completions", "top_k", "$.top_k"),
    ],
)
async def test_a_number_too_large_for_64_bits_is_a_422_naming_the_field(box, http, route, field, path) -> None:
    """Review: JSON integers have no size limit; `max_tokens` of 401 digits reached admission's float arithmetic
    (OverflowError: a 500) once the model had answered one generation, and an admitted one made every other
    request for the model a 500 while it ran."""
    base = CHAT if route == "/v1/chat/completions" else COMPLETION
    assert (await post(http, box, route, base))[0] == 200  # the model's pace is known: admission does the arithmetic
    body = json.dumps({**base, "max_tokens": None, field: 10**400})  # orjson writes 64-bit integers only
    async with http.post(url(box, route), data=body, headers={"Content-Type": "application/json"}) as response:
        status, answer = response.status, await response.json()
    assert status == 422, answer
    assert answer["error"]["code"] == "invalid_input" and path in answer["error"]["message"], answer


async def test_a_max_tokens_over_the_context_is_weighed_as_the_context_by_admission(box, http) -> None:
    """Black-box finding: `max_tokens` of 100,000 to a 128-token model was weighed whole by admission (an answer of
    at most the context's tokens): 48 of a burst of 80 refused 429 with Retry-After 60, for answers made in a
    second. A box holding the model says its context (`max_model_len`, vLLM's name), and the gateway caps by it."""
    async with http.get(url(box, f"/v1/models/{MODEL}")) as response:
        assert (await response.json())["max_model_len"] == 256  # the generator's max_position_embeddings
    status, answer = await post(http, box, "/v1/completions", {**COMPLETION, "max_tokens": 100_000})
    assert status == 200, answer
    (queue,) = [queue for (model, _), queue in box.dispatcher._admission._queues.items() if model == MODEL]
    *_, (_, _, tokens, cap) = queue.decoder.made
    assert cap == 256 and tokens <= 256  # weighed as the context, not as the 100,000 asked


@pytest.mark.parametrize(
    ("prompt", "status", "code", "said"),
    [
        ([1, 2, 3], 422, "unsupported_parameter", "`prompt` holds token ids"),
        ([[1, 2, 3]], 422, "unsupported_parameter", "`prompt` holds token ids"),
        (["one", "two"], 422, "invalid_input", "a list of exactly one string"),
        ([""], 422, "invalid_input", "`prompt` 0 is an empty string"),
        ([["one"]], 422, "invalid_input", "a list of exactly one string"),
        (["The quick brown fox"], 200, None, None),
    ],
)
async def test_a_prompt_of_token_ids_is_refused_by_name(box, http, prompt, status, code, said) -> None:
    """Generation tester: vLLM and the openai SDK's types take token ids as a prompt; fleetbox answered them with a
    schema error ("Expected `str`, got `int`"), not a refusal naming what it does not take."""
    got, answer = await post(http, box, "/v1/completions", {**COMPLETION, "prompt": prompt})
    assert got == status, answer
    if code is not None:
        assert answer["error"]["code"] == code and said in answer["error"]["message"], answer


async def test_a_generators_answers_are_in_its_heartbeat_stats_as_an_encoders_are(box, http) -> None:
    """`fleetbox models list` and the TUI read req/s and p50/p99 from the heartbeat: a generator's were left out, so a
    busy generator showed idle (h62)."""
    assert box.workers.stats(MODEL)["rps"] == 0.0
    for _ in range(3):
        status, body = await post(http, box, "/v1/completions", COMPLETION)
        assert status == 200, body
    stats = box.workers.stats(MODEL)
    assert stats["rps"] == 0.3, stats  # 3 answers in the 10 s window
    assert stats["p99_ms"] >= stats["p50_ms"] > 0, stats
