"""A chat template that raises is answered at once, never retried or dead-lettered: rendering the same
conversation again raises again. One that refuses the conversation (a Mistral-style "roles must alternate")
is the client's 400, as in vLLM; one that does not compile is refused at registration, and a 422 when it is
in the catalog anyway (a models file). The box, the queue and the tiny generator are real; only the template
in a copy of its folder changes."""

from __future__ import annotations

import shutil
from pathlib import Path

from appliance.settings import ModelEntry
from tests.conftest import url

STRICT = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}"
)
UNCLOSED = "{% for message in messages %}{{ message['content'] }"
# A Python error inside the template for this conversation (a number added to a string): raised as TypeError,
# which took the retry-then-dead-letter path of a model failure.
ADDS = "{% for message in messages %}{{ message['content'] + loop.index }}{% endfor %}"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def with_template(generator_dir: Path, folder: Path, template: str) -> Path:
    shutil.copytree(generator_dir, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def counted(box, metric: str, model: str) -> float:
    return box.metrics.registry.get_sample_value(metric, {"model": model}) or 0.0


async def chat(http, box, model: str, **fields) -> tuple[int, dict]:
    body = {"model": model, "messages": CONVERSATION, "max_tokens": 4, **fields}
    async with http.post(url(box, "/v1/chat/completions"), json=body) as response:
        return response.status, await response.json()


async def test_a_conversation_the_template_refuses_is_a_400_at_once(start_box, http, generator_dir, tmp_path) -> None:
    strict = with_template(generator_dir, tmp_path / "strict", STRICT)
    broken = with_template(generator_dir, tmp_path / "broken", UNCLOSED)
    models = [
        ModelEntry(name="strict", path=strict, task="generate", pinned=True),
        ModelEntry(name="broken", path=broken, task="generate", pinned=True),
    ]
    box = await start_box(default_model=False, models=models, max_deliver=3)
    for stream in (False, True):
        status, body = await chat(http, box, "strict", stream=stream)
        assert status == 400, body
        assert body["error"]["code"] == "chat_template_error"
        assert "Conversation roles must alternate" in body["error"]["message"]
    status, body = await chat(http, box, "broken")
    assert status == 422 and body["error"]["code"] == "invalid_chat_template", body
    for model in ("strict", "broken"):
        assert counted(box, "fbx_redelivered_requests_total", model) == 0
        assert counted(box, "fbx_dead_lettered_requests_total", model) == 0
    status, body = await chat(http, box, "strict", messages=CONVERSATION[1:])
    assert status == 200, body  # the same model, a conversation its template takes


async def test_a_generator_whose_chat_template_does_not_compile_is_refused_at_registration(
    start_box, http, generator_dir, tmp_path
) -> None:
    broken = with_template(generator_dir, tmp_path / "broken", UNCLOSED)
    box = await start_box(default_model=False, model_roots=[tmp_path])
    registration = {"name": "broken", "path": str(broken), "task": "generate"}
    async with http.post(url(box, "/v1/models"), json=registration) as response:
        status, body = response.status, await response.json()
    assert status == 422 and body["error"]["code"] == "unsupported_model", body
    assert "chat_template.jinja does not compile" in body["error"]["message"]
    assert "line 1" in body["error"]["message"]


async def test_a_python_error_inside_the_template_is_a_400_at_once(start_box, http, generator_dir, tmp_path) -> None:
    adds = with_template(generator_dir, tmp_path / "adds", ADDS)
    box = await start_box(
        default_model=False, models=[ModelEntry(name="adds", path=adds, task="generate", pinned=True)], max_deliver=3
    )
    status, body = await chat(http, box, "adds")
    assert (status, body["error"]["code"]) == (400, "chat_template_error"), body
    assert "TypeError" in body["error"]["message"]
    assert counted(box, "fbx_redelivered_requests_total", "adds") == 0


async def test_a_generator_without_a_chat_template_is_a_422_that_names_no_path(
    start_box, http, generator_dir, tmp_path
) -> None:
    """Tester h81: the 422 named the model's folder on the box, a path no client has any business with."""
    import orjson

    folder = tmp_path / "no-template"
    shutil.copytree(generator_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = orjson.loads((folder / "tokenizer_config.json").read_bytes())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    box = await start_box(default_model=False, models=[ModelEntry(name="plain", path=folder, task="generate")])
    status, body = await chat(http, box, "plain")
    assert (status, body["error"]["code"]) == (422, "no_chat_template"), body
    assert str(tmp_path) not in body["error"]["message"] and "/v1/completions" in body["error"]["message"], body
