"""Rerank, classify, extract and generate through the HTTP API, on random-weight models registered
through the admin API the way users register theirs, and checked against transformers itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from appliance.app import Box
from tests.conftest import box_with_models, url
from tests.models import BIO_LABELS, CLASS_LABELS

DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris.", "Cats sleep."]
TEXTS = ["Alice went to Paris with Bob.", "The weather in Berlin is fine today.", "numbers 12 and 345"]


@pytest.fixture(scope="module")
async def task_box(tmp_path_factory, model_dirs) -> AsyncIterator[Box]:
    """One box (one NATS) with the random models registered over HTTP."""
    tasks = {"ranker": "score", "sentiment": "classify", "ner": "extract", "tiny-llama": "generate"}
    folders = {name: model_dirs[_task(task)] for name, task in tasks.items()}
    async with box_with_models(tmp_path_factory, "task-box", folders) as (box, registered):
        assert {name: answer["task"] for name, answer in registered.items()} == tasks
        yield box


def _task(name: str):
    from runtimes import Task

    return Task(name)


async def post(http, box: Box, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(url(box, path), json=body) as response:
        return response.status, await response.json()


# -- rerank ----------------------------------------------------------------------------------------


def cross_encoder_scores(folder: Path, query: str, docs: list[str]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        inputs = tokenizer([query] * len(docs), docs, padding=True, truncation=True, return_tensors="pt")
        return torch.sigmoid(model(**inputs).logits[:, 0]).numpy()


async def test_rerank_sorts_documents_by_the_cross_encoders_score(task_box, http, model_dirs) -> None:
    status, body = await post(http, task_box, "/v1/rerank", {"model": "ranker", "query": "capital of France",
                                                              "documents": DOCS, "return_documents": True})  # fmt: skip
    assert status == 200, body
    expected = cross_encoder_scores(model_dirs[_task("score")], "capital of France", DOCS)
    results = body["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    for result in results:
        assert result["relevance_score"] == pytest.approx(float(expected[result["index"]]), abs=1e-5)
        assert result["document"] == {"text": DOCS[result["index"]]}
    assert body["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
async def test_rerank_is_also_mounted_where_cohere_and_jina_clients_look(task_box, http, path) -> None:
    docs = [{"text": d} for d in DOCS]
    status, body = await post(http, task_box, path, {"model": "ranker", "query": "q", "documents": docs, "top_n": 2})
    assert status == 200, body
    assert len(body["results"]) == 2 and "document" not in body["results"][0]


async def test_rerank_at_the_root_answers_teis_shape(task_box, http, model_dirs) -> None:
    """TEI's clients send `texts` (no `model`: a TEI server serves one) to `/rerank` and read a bare list; they got
    a 422 for the missing `model`, then for the missing `documents`."""
    expected = cross_encoder_scores(model_dirs[_task("score")], "capital of France", DOCS)
    async with http.post(url(task_box, "/rerank"), json={"query": "capital of France", "texts": DOCS}) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    assert [r["index"] for r in answer] == list(np.argsort(-expected, kind="stable"))
    for result in answer:
        assert set(result) == {"index", "score"}
        assert result["score"] == pytest.approx(float(expected[result["index"]]), abs=1e-5)
    body = {"query": "q", "texts": DOCS, "model": "ranker", "raw_scores": True, "return_text": True}
    async with http.post(url(task_box, "/rerank"), json=body) as response:
        raw = await response.json()
    assert all(r["text"] == DOCS[r["index"]] for r in raw)
    _, cohere = await post(http, task_box, "/v1/rerank", {"model": "ranker", "query": "q", "documents": DOCS})
    logits = {r["index"]: r["score"] for r in raw}
    for result in cohere["results"]:
        assert result["relevance_score"] == pytest.approx(1 / (1 + np.exp(-logits[result["index"]])), abs=1e-5)


async def test_a_cohere_document_object_comes_back_whole(task_box, http) -> None:
    """`return_documents` gave back only `text` of a document object; Cohere's API keeps its other fields."""
    docs = [{"text": "Paris is the capital of France.", "title": "Paris", "id": 7}, "Bananas are yellow."]
    body = {"model": "ranker", "query": "France", "documents": docs, "return_documents": True}
    status, answer = await post(http, task_box, "/v1/rerank", body)
    assert status == 200, answer
    assert {r["index"]: r["document"] for r in answer["results"]} == {0: docs[0], 1: {"text": docs[1]}}
    assert answer["id"]  # the request's id, as Cohere's answers carry one


async def test_a_document_object_comes_back_byte_for_byte(task_box, http) -> None:
    """Read again with another JSON parser, a number it reads otherwise made the answer a 500 after the model had
    scored (a 1e400 in a document's extra field), or changed it (a 23-digit id came back as a float)."""
    body = (b'{"model": "ranker", "query": "q", "return_documents": true, "documents": '
            b'[{"text": "Paris", "id": 12345678901234567890123, "weight": 1e400}, "Berlin"]}')  # fmt: skip
    headers = {"Content-Type": "application/json"}
    async with http.post(url(task_box, "/v1/rerank"), data=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        text = await response.text()
    assert '{"text": "Paris", "id": 12345678901234567890123, "weight": 1e400}' in text
    assert '{"text":"Berlin"}' in text


async def test_teis_texts_and_cohere_documents_together_are_refused(task_box, http) -> None:
    """Taken as TEI's, the documents, top_n and return_documents were ignored without a word."""
    body = {"query": "q", "texts": DOCS, "documents": DOCS, "top_n": 1}
    async with http.post(url(task_box, "/rerank"), json=body) as response:
        assert response.status == 422
        assert "not both" in (await response.json())["error"]["message"]


async def test_rerank_raw_scores_are_the_logits(task_box, http) -> None:
    _, plain = await post(http, task_box, "/v1/rerank", {"model": "ranker", "query": "q", "documents": DOCS})
    _, raw = await post(http, task_box, "/v1/rerank", {"model": "ranker", "query": "q", "documents": DOCS,
                                                        "raw_scores": True})  # fmt: skip
    by_index = {r["index"]: r["relevance_score"] for r in raw["results"]}
    for result in plain["results"]:
        assert result["relevance_score"] == pytest.approx(1 / (1 + np.exp(-by_index[result["index"]])), abs=1e-5)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "ranker", "documents": DOCS}, 422, "invalid_input"),
        ({"model": "ranker", "query": "q", "documents": []}, 422, "invalid_input"),
        ({"model": "ranker", "query": "q", "documents": DOCS, "top_n": 0}, 422, "invalid_input"),
        ({"model": "ranker", "query": "", "documents": DOCS}, 422, "invalid_input"),
        ({"model": "ranker", "query": "q", "documents": ["a", ""]}, 422, "empty_input"),
        ({"model": "ranker", "query": "q", "documents": DOCS, "adapter": "nope"}, 404, "adapter_not_found"),
        ({"model": "ranker:nope", "query": "q", "documents": DOCS}, 404, "model_not_found"),
        ({"model": "sentiment", "query": "q", "documents": DOCS}, 422, "wrong_task"),
        ({"model": "nothing", "query": "q", "documents": DOCS}, 404, "model_not_found"),
        ({"query": "q", "texts": []}, 422, "invalid_input"),
        ({"query": "q", "texts": DOCS, "truncation_direction": "Left"}, 422, "unsupported_parameter"),
        ({"query": "q", "texts": DOCS, "model": "sentiment"}, 422, "wrong_task"),
    ],
)
async def test_bad_rerank_requests_are_clear_4xx(task_box, http, body, status, code) -> None:
    got, payload = await post(http, task_box, "/rerank" if "texts" in body else "/v1/rerank", body)
    assert got == status, payload
    assert payload["error"]["code"] == code


async def test_too_many_documents_are_counted_as_documents(task_box, http) -> None:
    """Tester h103: the 413 counted a rerank's documents as "inputs", a field the request does not have."""
    limit = task_box.settings.max_inputs
    status, payload = await post(
        http, task_box, "/v1/rerank", {"model": "ranker", "query": "q", "documents": ["b"] * (limit + 1)}
    )
    assert (status, payload["error"]["code"]) == (413, "too_many_inputs"), payload
    assert payload["error"]["message"] == f"{limit + 1} documents is more than the limit of {limit} per request"


async def test_tei_rerank_errors_name_its_texts(task_box, http) -> None:
    """Tester h121: TEI's rerank, queued as fleetbox's, was told of `documents` it never sent."""
    limit = task_box.settings.max_inputs
    status, payload = await post(http, task_box, "/rerank", {"query": "q", "texts": ["a", ""]})
    assert (status, payload["error"]["message"]) == (422, "text 1 is an empty string"), payload
    status, payload = await post(http, task_box, "/rerank", {"query": "q", "texts": ["b"] * (limit + 1)})
    assert (status, payload["error"]["message"]) == (
        413,
        f"{limit + 1} texts is more than the limit of {limit} per request",
    )


async def test_an_over_long_pair_is_named_by_its_document(task_box, http) -> None:
    body = {"model": "ranker", "query": "q", "documents": ["short", "word " * 600], "truncate": False}
    status, payload = await post(http, task_box, "/v1/rerank", body)
    assert status == 413, payload
    assert payload["error"]["code"] == "input_too_long"
    assert payload["error"]["message"].startswith("the query with document 1 is longer"), payload
    assert '"truncate": true' in payload["error"]["message"]


# -- classify --------------------------------------------------------------------------------------


async def test_classify_gives_labels_from_id2label_best_first(task_box, http, model_dirs) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = model_dirs[_task("classify")]
    status, body = await post(http, task_box, "/v1/classify", {"model": "sentiment", "input": TEXTS})
    assert status == 200, body
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        probs = torch.softmax(model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits, -1).numpy()
    assert len(body["data"]) == len(TEXTS)
    for predictions, row in zip(body["data"], probs, strict=True):
        assert [p["label"] for p in predictions] == [CLASS_LABELS[i] for i in np.argsort(-row, kind="stable")]
        assert predictions[0]["score"] == pytest.approx(float(row.max()), abs=1e-5)


async def test_classify_top_k_keeps_the_best(task_box, http) -> None:
    status, body = await post(http, task_box, "/v1/classify", {"model": "sentiment", "input": "one", "top_k": 1})
    assert status == 200 and len(body["data"]) == 1 and len(body["data"][0]) == 1


async def test_classify_with_an_embedding_route_is_wrong_task(task_box, http) -> None:
    status, body = await post(http, task_box, "/v1/embeddings", {"model": "sentiment", "input": "x"})
    assert status == 422 and body["error"]["code"] == "wrong_task"


# -- extract ---------------------------------------------------------------------------------------


async def test_extract_matches_the_transformers_pipeline_simple_strategy(task_box, http, model_dirs) -> None:
    from transformers import pipeline

    folder = model_dirs[_task("extract")]
    status, body = await post(http, task_box, "/v1/extract", {"model": "ner", "input": TEXTS})
    assert status == 200, body
    reference = pipeline("token-classification", model=str(folder), aggregation_strategy="simple", device="cpu")
    assert any(body["data"]), "the random head should tag something"
    for text, ours in zip(TEXTS, body["data"], strict=True):
        theirs = reference(text)
        assert [(e["label"], e["start"], e["end"]) for e in ours] == [
            (e["entity_group"], e["start"], e["end"]) for e in theirs
        ]
        for mine, expected in zip(ours, theirs, strict=True):
            assert mine["score"] == pytest.approx(float(expected["score"]), abs=1e-4)
            assert mine["text"] == text[mine["start"] : mine["end"]]
            assert mine["label"] in {label.split("-")[-1] for label in BIO_LABELS}


# -- generate --------------------------------------------------------------------------------------


def greedy_reference(folder: Path, prompt_ids: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


async def test_completion_greedy_equals_model_generate(task_box, http, model_dirs) -> None:
    from transformers import AutoTokenizer

    folder = model_dirs[_task("generate")]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = "The quick brown fox"
    status, body = await post(http, task_box, "/v1/completions", {"model": "tiny-llama", "prompt": prompt,
                                                                   "max_tokens": 12, "temperature": 0})  # fmt: skip
    assert status == 200, body
    ids = tokenizer(prompt)["input_ids"]
    expected_ids = greedy_reference(folder, ids, 12)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos in expected_ids:
        expected_ids = expected_ids[: expected_ids.index(eos)]
    assert body["choices"][0]["text"] == tokenizer.decode(expected_ids)
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


async def test_chat_completion_uses_the_models_chat_template(task_box, http) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    status, body = await post(http, task_box, "/v1/chat/completions", {"model": "tiny-llama", "messages": messages,
                                                                        "max_tokens": 8, "seed": 3})  # fmt: skip
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 8
    again = await post(http, task_box, "/v1/chat/completions", {"model": "tiny-llama", "messages": messages,
                                                                 "max_tokens": 8, "seed": 3})  # fmt: skip
    assert again[1]["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


async def test_streamed_chat_sends_openai_chunks_and_ends_with_done(task_box, http) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with http.post(url(task_box, "/v1/chat/completions"), json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"  # tester h81: read as latin-1
        assert response.headers["Fbx-Request-Id"] == response.headers["X-Request-Id"]  # OpenAI's SDK reads the latter
        request_id = response.headers["Fbx-Request-Id"]
        raw = await response.text()
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    # The request id, unique across gateways (a clock's nanoseconds were not: h200), finds the box's log lines.
    assert {c["id"] for c in chunks} == {f"chatcmpl-{request_id}"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    whole = await post(http, task_box, "/v1/chat/completions", {**body, "stream": False, "stream_options": None})
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == whole[1]["choices"][0]["message"]["content"]
    assert whole[1]["id"].startswith("chatcmpl-") and whole[1]["id"] != chunks[0]["id"]


async def test_a_clients_own_request_id_is_echoed_in_x_request_id(task_box, http) -> None:
    """A client's `X-Request-Id` was dropped, the answer's carrying the box's id instead: the client's tracing could
    not tie the answer to its call (vLLM and proxies echo it). The box's own id stays in `Fbx-Request-Id`."""
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    async with http.post(url(task_box, "/v1/chat/completions"), json=body, headers={"X-Request-Id": "trace-42"}) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "trace-42"
        assert r.headers["Fbx-Request-Id"] not in ("", "trace-42")
        await r.read()
    whole = {**body, "stream": False}
    async with http.post(url(task_box, "/v1/chat/completions"), json=whole, headers={"X-Request-Id": "t-7"}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "t-7"
    unknown = {**whole, "model": "no-such-model"}
    async with http.post(url(task_box, "/v1/chat/completions"), json=unknown, headers={"X-Request-Id": "t-8"}) as r:
        assert r.status == 404 and r.headers["X-Request-Id"] == "t-8"  # errors too
    for odd in ("two words", "x" * 201):  # not echoed: the box's own id, as when none is sent
        async with http.post(url(task_box, "/v1/chat/completions"), json=whole, headers={"X-Request-Id": odd}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == r.headers["Fbx-Request-Id"]


async def stream_chunks(http, box: Box, path: str, body: dict) -> list[dict]:
    """The chunk objects of a streamed answer, `[DONE]` checked and left out."""
    async with http.post(url(box, path), json=body) as response:
        assert response.status == 200, await response.text()
        raw = await response.text()
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


async def test_streamed_chunks_have_openais_fields_even_without_text(task_box, http, model_dirs) -> None:
    """The first chat delta carries `content` beside the role ("" when it has no text), and with `include_usage`
    every chunk but the usage one carries `usage: null`, as OpenAI's do: the first delta was {"role": "assistant"}
    alone and the other chunks had no `usage`."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(model_dirs[_task("generate")]).convert_tokens_to_ids("<|im_end|>")
    streamed = {"model": "tiny-llama", "stream": True, "stream_options": {"include_usage": True}}
    chat = streamed | {"messages": [{"role": "user", "content": "Hi"}]}
    at_once = await stream_chunks(http, task_box, "/v1/chat/completions", chat | {"logit_bias": {str(end): 100}})
    assert [c["choices"][0]["delta"] for c in at_once[:-1]] == [{"role": "assistant", "content": ""}]
    assert at_once[0]["choices"][0]["finish_reason"] == "stop" and at_once[0]["usage"] is None
    assert at_once[-1]["choices"] == [] and at_once[-1]["usage"]["completion_tokens"] == 1
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", streamed | {"prompt": "Hi"})):
        chunks = await stream_chunks(http, task_box, path, body | {"max_tokens": 4, "temperature": 0})
        assert len(chunks) > 2 and all(c["usage"] is None for c in chunks[:-1]), chunks
        assert chunks[-1]["usage"]["completion_tokens"] >= 1
    chunks = await stream_chunks(http, task_box, "/v1/chat/completions", chat | {"stream_options": None})
    assert isinstance(chunks[0]["choices"][0]["delta"]["content"], str)
    assert all("usage" not in c for c in chunks)  # not asked for: not there, as OpenAI's


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/completions", {"prompt": "word " * 400}, "the prompt is longer"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, "the conversation"),
    ],
)
async def test_an_over_long_prompt_says_to_send_truncate_true(task_box, http, path, body, named) -> None:
    """`truncate` defaults to false for generation: the advice is to send true, and there is no "input 0"."""
    status, payload = await post(http, task_box, path, {"model": "tiny-llama", "max_tokens": 2, **body})
    assert status == 413, payload
    assert payload["error"]["code"] == "input_too_long"
    message = payload["error"]["message"]
    assert message.startswith(named) and '"truncate": true' in message and "input 0" not in message, message


async def test_null_optional_fields_and_a_tool_call_turn_are_openai_compatible(task_box, http) -> None:
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "stream_options", "seed", "stop", "max_tokens",
                           "presence_penalty", "frequency_penalty", "user", "truncate", "timeout"))  # fmt: skip
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Call f"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": "done"},
    ]
    chat = {"model": "tiny-llama", "messages": messages, **nulls, "max_completion_tokens": 2}
    status, payload = await post(http, task_box, "/v1/chat/completions", chat)
    assert status == 200, payload
    assert payload["object"] == "chat.completion"
    status, payload = await post(http, task_box, "/v1/completions", {"model": "tiny-llama", "prompt": "x", **nulls})
    assert status == 200, payload
    chat |= {"stream": True, "stream_options": {"include_usage": None}}  # stream_options goes with a stream only
    async with http.post(url(task_box, "/v1/chat/completions"), json=chat) as response:
        assert response.status == 200, await response.text()
        assert "data: [DONE]" in await response.text()


async def test_openai_sdk_streams_completions(task_box) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url(task_box, "/v1"), api_key="unused", max_retries=0)
    try:
        stream = await client.completions.create(model="tiny-llama", prompt="Paris is", max_tokens=6, stream=True)
        parts = [chunk.choices[0].text async for chunk in stream]
    finally:
        await client.close()
    assert len(parts) >= 1


async def test_concurrent_generations_decode_together(task_box, http) -> None:
    metrics = task_box.metrics.registry
    before = metrics.get_sample_value("fbx_batch_size_count", {"model": "tiny-llama"}) or 0
    rows_before = metrics.get_sample_value("fbx_rows_computed_total", {"model": "tiny-llama"}) or 0

    def count(name: str) -> float:
        return metrics.get_sample_value(f"{name}_count", {"model": "tiny-llama"}) or 0

    first_tokens, per_token = count("fbx_time_to_first_token_ms"), count("fbx_time_per_output_token_ms")
    bodies = [
        {"model": "tiny-llama", "prompt": f"Request {i} says", "max_tokens": 24, "temperature": 0} for i in range(6)
    ]
    results = await asyncio.gather(*(post(http, task_box, "/v1/completions", b) for b in bodies))
    assert all(status == 200 for status, _ in results)
    queued = metrics.get_sample_value("fbx_queue_ms_count", {"model": "tiny-llama"}) or 0
    assert queued >= len(bodies)  # each generation's wait for its first step, as for every model
    steps = (metrics.get_sample_value("fbx_batch_size_count", {"model": "tiny-llama"}) or 0) - before
    rows = (metrics.get_sample_value("fbx_rows_computed_total", {"model": "tiny-llama"}) or 0) - rows_before
    tokens = sum(body["usage"]["completion_tokens"] for _, body in results)
    assert rows == tokens
    assert steps < tokens  # one after another would take one step per token
    # vLLM's serving metrics, per generation: its wait for a first token, and its pace after it.
    assert count("fbx_time_to_first_token_ms") - first_tokens == len(bodies)
    longer = sum(body["usage"]["completion_tokens"] > 1 for _, body in results)
    assert count("fbx_time_per_output_token_ms") - per_token == longer > 0
    # A box's error answer (a token the model does not have, found at its prefill) is no first token (tester h130).
    status, _ = await post(http, task_box, "/v1/completions", {**bodies[0], "logit_bias": {"999999": 5}})
    assert status == 422
    assert count("fbx_time_to_first_token_ms") - first_tokens == len(bodies)
    # An idle generator pulls room for its decode batch and as many again, not the box's encoder batch size.
    worker = task_box.workers["tiny-llama"]
    assert worker.held == 0 and worker._room() == 2 * worker.runtime.decode_batch == 64


async def test_a_generation_whose_prefill_fails_is_dead_lettered_alone(task_box, http, monkeypatch) -> None:
    """Fault injected into the box's real runtime: the prefill of one prompt raises (as out of memory would).

    It fails on every delivery, so it is dead-lettered; the others are answered as they would be alone."""
    prompts = ["Request one says", "Poison pill", "Request two says"]
    bodies = [{"model": "tiny-llama", "prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]
    alone = [await post(http, task_box, "/v1/completions", bodies[i]) for i in (0, 2)]  # loads the model too
    runtime = task_box.workers["tiny-llama"].runtime
    culprit = torch.as_tensor(runtime.tokenize([prompts[1]])[0].ids)
    prefill = runtime._prefill

    def failing_prefill(prompts, adapters, **kwargs):
        if any(len(p) == len(culprit) and torch.equal(p.cpu(), culprit) for p in prompts):
            raise RuntimeError("out of memory (injected)")
        return prefill(prompts, adapters, **kwargs)

    monkeypatch.setattr(runtime, "_prefill", failing_prefill)
    results = await asyncio.gather(*(post(http, task_box, "/v1/completions", b) for b in bodies))
    assert [status for status, _ in results] == [200, 422, 200]
    assert results[1][1]["error"]["code"] == "dead_lettered" and "injected" in results[1][1]["error"]["message"]
    for (_, body), (_, reference) in zip(results[::2], alone, strict=True):
        assert body["choices"][0]["text"] == reference["choices"][0]["text"]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {"model": "tiny-llama", "prompt": ""}, 422),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, 422),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "temperature": -1}, 422),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 2}, 422),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 422),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}, 422),
        ("/v1/chat/completions", {"model": "ranker", "messages": [{"role": "user", "content": "x"}]}, 422),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "word " * 400, "truncate": False}, 413),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "seed": 2**63}, 422),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "seed": -(2**63) - 1}, 422),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user"}]}, 422),
    ],
)
async def test_bad_generation_requests_are_clear_4xx(task_box, http, path, body, status) -> None:
    got, payload = await post(http, task_box, path, body)
    assert got == status, payload
    assert set(payload["error"]) == {"message", "type", "code"}
    if status == 422 and "seed" in body:  # a seed torch cannot take is named, with its range
        assert "`$.seed`" in payload["error"]["message"] and "9223372036854775" in payload["error"]["message"]


async def test_rerank_scores_take_the_activation_the_reranker_was_saved_with_but_at_teis_shape_teis(
    start_box, http, cross_encoder_dir, tmp_path
):
    """Stock-client tester: a reranker whose config.json names `Identity` (sentence-transformers' field) answered
    sigmoids where `CrossEncoder.predict` returns its logits."""
    from sentence_transformers import CrossEncoder

    from appliance.settings import ModelEntry
    from tests.models import with_config

    activation = {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    folder = with_config(cross_encoder_dir, tmp_path / "identity", **activation)
    box = await start_box(default_model=False, models=[ModelEntry(name="plain", path=folder, task="score")])
    status, answer = await post(http, box, "/v1/rerank", {"model": "plain", "query": "capital", "documents": DOCS})
    assert status == 200, answer
    scores = {result["index"]: result["relevance_score"] for result in answer["results"]}
    expected = CrossEncoder(str(folder), device="cpu").predict([("capital", doc) for doc in DOCS])
    np.testing.assert_allclose([scores[i] for i in range(len(DOCS))], expected, atol=1e-5)
    assert min(expected) < 0  # logits, not probabilities
    # TEI's shape scores as a TEI server does (its `predict`: the sigmoid of a one-logit model's score unless
    # `raw_scores`), whatever the config names: a TEI client's threshold of 0.5 keeps meaning what it meant (h200).
    tei = {"model": "plain", "query": "capital", "texts": DOCS}
    for raw, squash in ((False, lambda x: 1 / (1 + np.exp(-x))), (True, lambda x: x)):
        status, listed = await post(http, box, "/rerank", {**tei, "raw_scores": raw})
        assert status == 200, listed
        got = {result["index"]: result["score"] for result in listed}
        np.testing.assert_allclose([got[i] for i in range(len(DOCS))], squash(expected), atol=1e-5)


async def test_rerank_max_tokens_per_doc_scores_each_documents_first_tokens(task_box, http, model_dirs) -> None:
    """Cohere v2's `max_tokens_per_doc` was accepted and ignored (the same scores as without it: stock-client
    tester h42). Each document is cut after its first tokens, as if sent cut."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs[_task("score")])
    cut = []
    for doc in DOCS:
        spans = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        cut.append(doc[: spans[2][1]] if len(spans) > 3 else doc)
    assert cut != DOCS
    query = {"model": "ranker", "query": "capital of France", "raw_scores": True}
    status, limited = await post(http, task_box, "/v2/rerank", {**query, "documents": DOCS, "max_tokens_per_doc": 3})
    assert status == 200, limited
    status, sent_cut = await post(http, task_box, "/v2/rerank", {**query, "documents": cut})
    status, whole = await post(http, task_box, "/v2/rerank", {**query, "documents": DOCS, "max_tokens_per_doc": 512})

    def scores(answer: dict) -> list[float]:
        return [r["relevance_score"] for r in sorted(answer["results"], key=lambda r: r["index"])]

    np.testing.assert_allclose(scores(limited), scores(sent_cut), atol=1e-5)
    assert limited["usage"]["total_tokens"] == sent_cut["usage"]["total_tokens"] < whole["usage"]["total_tokens"]


async def test_rerank_fields_other_than_text_are_refused_not_ignored(task_box, http) -> None:
    """Tester h121: Cohere's `rank_fields` was ignored, and documents alike in `text` ranked by chance where the
    client asked for their titles."""
    documents = [{"text": "x", "title": "Paris"}, {"text": "x", "title": "Banana"}]
    body = {"model": "ranker", "query": "capital", "documents": documents}
    status, answer = await post(http, task_box, "/v1/rerank", {**body, "rank_fields": ["title"]})
    assert (status, answer["error"]["code"]) == (422, "unsupported_parameter"), answer
    assert answer["error"]["message"].startswith("`rank_fields` ['title']: fleetbox ranks each document by its `text`")
    assert (await post(http, task_box, "/v1/rerank", {**body, "rank_fields": ["text"]}))[0] == 200


async def test_an_empty_adapter_is_refused_as_such(task_box, http) -> None:
    status, answer = await post(http, task_box, "/v1/rerank", {"model": "ranker", "query": "q", "documents": ["a"],
                                                                "adapter": ""})  # fmt: skip
    assert (status, answer["error"]["code"]) == (422, "invalid_input"), answer
    assert answer["error"]["message"] == "`adapter` is an empty string; leave it out (or null) for the model itself"


async def test_rerank_max_chunks_per_doc_above_one_is_refused_by_name(task_box, http) -> None:
    """Cohere v1's chunking (the best of several windows of a long document) is not what fleetbox does: refused, not
    ignored; 1 (a document's first window) is what it does."""
    body = {"model": "ranker", "query": "capital", "documents": DOCS}
    status, answer = await post(http, task_box, "/v1/rerank", {**body, "max_chunks_per_doc": 10})
    assert status == 422 and answer["error"]["code"] == "unsupported_parameter", answer
    assert answer["error"]["message"].startswith("`max_chunks_per_doc` 10: fleetbox scores each document whole")
    assert (await post(http, task_box, "/v1/rerank", {**body, "max_chunks_per_doc": 1}))[0] == 200
