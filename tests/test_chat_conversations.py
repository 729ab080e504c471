"""A chat reaches the model's template as vLLM hands it over: content parts joined by newlines, `null` content as "",
the history's tool calls (their JSON arguments parsed) and a tool turn's call id kept. The runtime, the worker's
request decoding and the box are real; only the chat template in a copy of the generator's folder changes, to one
that writes each message it is given as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

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
