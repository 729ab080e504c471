"""A chat reaches the model's template as vLLM hands it over, and vLLM's template controls are honoured, not ignored.

Content parts are joined by newlines, `null` content is "", the history's tool calls (their JSON arguments parsed)
and a tool turn's call id are kept; `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`
reach the template. What would change the render call rather than the template's text (a variable named as one of
its arguments, both controls on at once, a template of the request's own) is a 422. The runtime, the worker's
request decoding and the box are real; only the chat template in a copy of the generator's folder changes, to one
that writes each message it is given as JSON.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from appliance.errors import Unprocessable
from appliance.generation_request import decode_generation, prompt_ids
from appliance.settings import ModelEntry
from runtimes import ModelSource, Task, load_runtime
from tests.conftest import url
from tests.test_chat_template_errors import with_template

# Each message as JSON on a line of its own, then what the call's controls and variables were.
ECHO = (
    "{% for message in messages %}{{ message | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}GEN{% endif %}"
    "{% if enable_thinking is defined %}THINK={{ enable_thinking }}{% endif %}"
)
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
TOOL_TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}], "name": "bob"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]

Render = Callable[..., str]


@pytest.fixture(scope="module")
def echo_dir(generator_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(generator_dir, tmp_path_factory.mktemp("echo") / "echo", ECHO)


def renderer(folder: Path) -> Iterator[Render]:
    """The prompt text the worker renders for a chat body, for the model in `folder`."""
    from transformers import AutoTokenizer

    runtime = load_runtime(ModelSource(folder, Task.GENERATE))
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def render(**body: object) -> str:
        ids = prompt_ids(runtime, decode_generation(orjson.dumps({"model": "m", **body})))
        return tokenizer.decode(ids.tolist())

    yield render
    runtime.close()


@pytest.fixture(scope="module")
def echoed(echo_dir: Path) -> Iterator[Render]:
    yield from renderer(echo_dir)


@pytest.fixture(scope="module")
def chatml(generator_dir: Path) -> Iterator[Render]:
    yield from renderer(generator_dir)


def test_tool_call_history_and_content_parts_reach_the_template_as_vllm_hands_them_over(echoed: Render) -> None:
    """Tool calls and the tool call id were dropped, and text parts joined with nothing between them."""
    *lines, last = echoed(messages=TOOL_TURNS).split("\n")
    assert [json.loads(line) for line in lines] == [
        {"role": "user", "content": "Hello\nthere", "name": "bob"},
        {"role": "assistant", "content": "", "tool_calls": [CALL | {"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert last == "GEN"
    not_json = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{x"}}
    turn, _ = echoed(messages=[{"role": "assistant", "content": "", "tool_calls": [not_json]}]).split("\n")
    assert json.loads(turn)["tool_calls"] == [not_json]  # kept as sent, not replaced by {}


def test_template_controls_and_variables_reach_the_template(echoed: Render) -> None:
    """`add_generation_prompt: false` and `chat_template_kwargs` were accepted and ignored."""
    messages = [{"role": "user", "content": "Hi"}]
    assert echoed(messages=messages).endswith("\nGEN")
    no_prompt = echoed(messages=messages, add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False})
    assert no_prompt.endswith('"Hi"}\nTHINK=False'), no_prompt


def test_continue_final_message_leaves_the_last_turn_open(chatml: Render) -> None:
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris is"}]
    closed = chatml(messages=messages, add_generation_prompt=False)
    assert closed.endswith("Paris is<|im_end|>\n"), closed
    opened = chatml(messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert opened == closed.removesuffix("<|im_end|>\n"), opened


@pytest.fixture
async def echo_box(start_box, echo_dir: Path):
    return await start_box(
        default_model=False, models=[ModelEntry(name="echo", path=echo_dir, task="generate", pinned=True)]
    )


async def chat(http, box, **fields: object) -> tuple[int, dict]:
    body = {"model": "echo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
    async with http.post(url(box, "/v1/chat/completions"), json=body) as response:
        return response.status, await response.json()


async def test_tool_calls_outside_an_assistant_turn_are_a_422(echo_box, http) -> None:
    """As OpenAI refuses them, rather than a template showing them in another turn."""
    turn = {"role": "user", "content": "Hi", "tool_calls": [CALL]}
    status, body = await chat(http, echo_box, messages=[turn])
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "tool_calls is only allowed in an assistant message" in body["error"]["message"]
    status, body = await chat(http, echo_box, messages=[{"role": "user", "content": "Hi", "tool_call_id": "c1"}])
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "tool_call_id is only allowed in a tool message" in body["error"]["message"]


async def test_a_tool_turn_without_its_call_id_and_an_empty_list_of_parts_are_a_422(echo_box, http) -> None:
    """Tester h81: both were answered 200 (the list read as empty text), where OpenAI answers 400."""
    untied = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}]
    status, body = await chat(http, echo_box, messages=untied)
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "a tool message needs the tool_call_id" in body["error"]["message"]
    status, body = await chat(http, echo_box, messages=[{"role": "user", "content": []}])
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body


def test_an_assistant_turn_of_tool_calls_may_leave_its_content_out(echoed: Render) -> None:
    """As the openai SDK's types and vLLM allow it (h62: a 422 `missing required field content`); it reaches the
    template as the same turn with `content` null."""
    without = [TOOL_TURNS[0], {"role": "assistant", "tool_calls": [CALL]}, TOOL_TURNS[2]]
    assert echoed(messages=without) == echoed(messages=TOOL_TURNS)


@pytest.mark.parametrize("turn", [{"role": "user"}, {"role": "user", "content": None}])  # null: h86, a 200
async def test_a_message_of_another_role_without_content_is_a_422(echo_box, http, turn: dict) -> None:
    status, body = await chat(http, echo_box, messages=[turn])
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "a user message needs its content" in body["error"]["message"], body


async def test_chat_template_kwargs_reach_the_template_through_the_box(echo_box, http, echo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(echo_dir)
    messages = [{"role": "user", "content": "Hi"}]
    for variables in ({}, {"enable_thinking": False}):
        # The other controls at their defaults, as a vLLM client may send them.
        defaults = {"add_generation_prompt": True, "continue_final_message": False, "chat_template": None}
        status, body = await chat(http, echo_box, chat_template_kwargs=variables, echo=False, **defaults)
        assert status == 200, body
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **variables
        )
        assert body["usage"]["prompt_tokens"] == len(expected), variables


@pytest.mark.parametrize(
    "name", ["tokenize", "messages", "conversation", "add_generation_prompt", "tools", "chat_template", "return_dict"]
)
def test_a_template_variable_named_as_an_argument_of_the_call_is_refused(echoed: Render, name: str) -> None:
    """Passed on, it would override the worker's own arguments (`tokenize`: text where ids are read) or raise a
    TypeError (given twice); the whole field was ignored before."""
    with pytest.raises(Unprocessable, match=f"chat_template_kwargs: `{name}`"):
        echoed(messages=[{"role": "user", "content": "Hi"}], chat_template_kwargs={name: True, "fine": 1})


async def test_what_would_change_the_call_is_a_422_at_the_box(echo_box, http) -> None:
    """Both were answered 200 as if not sent."""
    status, body = await chat(http, echo_box, chat_template_kwargs={"tokenize": False, "padding": True})
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "chat_template_kwargs: `padding`, `tokenize`" in body["error"]["message"]
    status, body = await chat(http, echo_box, continue_final_message=True)
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in body["error"]["message"]


async def test_a_generators_folder_moved_away_after_its_load_still_chats(start_box, http, generator_dir, tmp_path):
    """Tester h74: the chat template's tokenizer was read from the folder at the first chat, so a folder moved away
    after the load made every chat a 422 dead-lettered after five deliveries (`Repo id must be in the form ...`),
    while completions went on. It is read with the model."""
    folder = tmp_path / "gen"
    shutil.copytree(generator_dir, folder)
    model = ModelEntry(name="gen", path=folder, task="generate", pinned=True)
    box = await start_box(default_model=False, models=[model], model_roots=[tmp_path])
    folder.rename(tmp_path / "moved")
    body = {"model": "gen", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    async with http.post(url(box, "/v1/chat/completions"), json=body) as response:
        assert response.status == 200, await response.text()


@pytest.mark.parametrize("where", ["arguments", "chat_template_kwargs"])
async def test_a_value_nested_too_deeply_to_render_is_a_422_at_once_not_dead_lettered(echo_box, http, where) -> None:
    """Tester h185: tool call arguments (or a template variable) nested 500-1,000 deep, under the gateway's JSON
    limit, raised RecursionError as the worker measured the chat: tried on all five deliveries, then dead-lettered
    (a 422 `dead_lettered` naming the RecursionError) and kept in FBX_DLQ."""
    deep = "[" * 700 + "]" * 700
    if where == "arguments":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
        fields: dict = {"messages": [{"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "x"}]}
    else:
        fields = {"chat_template_kwargs": {"deep": orjson.loads(deep)}}
    status, payload = await chat(http, echo_box, **fields)
    assert (status, payload["error"]["code"]) == (422, "invalid_input"), payload
    assert "nested too deeply" in payload["error"]["message"]
    assert echo_box.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": "echo"}) in (
        None,
        0.0,
    )
    status, payload = await chat(http, echo_box)
    assert status == 200, payload


def test_a_conversation_its_template_renders_empty_is_told_so(generator_dir: Path, tmp_path: Path) -> None:
    """Tester h185: a template that wrote nothing for the conversation was a 422 saying "a prompt is a non-empty
    sequence of token ids", of ids the client never sent."""
    folder = with_template(
        generator_dir, tmp_path / "content-only", "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    renders = renderer(folder)
    render = next(renders)
    try:
        with pytest.raises(Unprocessable, match="rendered with the model's chat template, is empty"):
            render(messages=[{"role": "user", "content": ""}])
        assert render(messages=[{"role": "user", "content": "Hi"}]) == "Hi"
    finally:
        next(renders, None)  # the runtime closed
