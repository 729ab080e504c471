"""Infinity's routes at a box's root, as an Infinity server serves them, with the bodies Infinity's Python client
(`infinity_client`) sends and the answers it reads. That client is not installed with fleetbox: each test posts
the wire shape of the client call it names (its defaults included: `model` "default/not-specified",
`dimensions` 0, `modality` "text", `raw_scores` false) and checks what that call's parser requires."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from appliance.app import Box
from appliance.catalog import DEFAULT_MODEL_NAME
from tests.conftest import box_with_models, url

TEXTS = ["A man is eating food.", "The weather in Berlin is fine today."]
UNNAMED = "default/not-specified"  # Infinity's client's `model` when its user names none


@pytest.fixture(scope="module")
async def infinity_box(tmp_path_factory, classifier_dir, cross_encoder_dir) -> AsyncIterator[Box]:
    """The packaged embedder, one classifier and one reranker: one model of each Infinity task."""
    models = {"sentiment": classifier_dir, "reranker": cross_encoder_dir}
    async with box_with_models(tmp_path_factory, "infinity-box", models) as (box, _):
        yield box


async def post(http, box: Box, path: str, body: object) -> tuple[int, dict]:
    async with http.post(url(box, path), json=body) as response:
        return response.status, await response.json()


@pytest.mark.parametrize("path", ["/embeddings", "/v1/embeddings"])
async def test_infinity_embeddings_defaults_are_the_fleets_embedder_at_full_width(infinity_box, http, path) -> None:
    """`embeddings.sync(client, body=OpenAIEmbeddingInputText(input_=TEXTS))`, base URL the root or `/v1`: its
    `dimensions` 0 is the whole width (it was a 422), its model the fleet's one embedder (it was a 404)."""
    body = {"input": TEXTS, "model": UNNAMED, "dimensions": 0, "modality": "text"}
    status, answer = await post(http, infinity_box, path, body)
    assert status == 200, answer
    assert answer["model"] == DEFAULT_MODEL_NAME and answer["object"] == "list"
    assert set(answer["usage"]) >= {"prompt_tokens", "total_tokens"}
    got = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
    _, named = await post(http, infinity_box, "/v1/embeddings", {"input": TEXTS, "model": DEFAULT_MODEL_NAME})
    np.testing.assert_array_equal(got, np.array([item["embedding"] for item in named["data"]], dtype=np.float32))
    assert got.shape == (2, 384)


async def test_dimensions_zero_is_no_cut_with_a_named_model_too(infinity_box, http) -> None:
    status, answer = await post(http, infinity_box, "/v1/embeddings", {"input": "x", "model": DEFAULT_MODEL_NAME,
                                                                       "dimensions": 0})  # fmt: skip
    assert status == 200, answer
    assert len(answer["data"][0]["embedding"]) == 384
    status, answer = await post(http, infinity_box, "/v1/embeddings", {"input": "x", "model": DEFAULT_MODEL_NAME,
                                                                       "dimensions": -1})  # fmt: skip
    assert status == 422 and answer["error"]["code"] == "invalid_input", answer


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
async def test_infinity_classify_without_a_model_is_the_fleets_classifier(infinity_box, http, path) -> None:
    """`classify.sync(client, body=ClassifyInput(input_=TEXTS))`: `ClassifyResult.from_dict` reads `data` (lists of
    `{score, label}`), `model` and `usage`."""
    status, answer = await post(http, infinity_box, path, {"input": TEXTS, "model": UNNAMED, "raw_scores": False})
    assert status == 200, answer
    _, named = await post(http, infinity_box, "/v1/classify", {"input": TEXTS, "model": "sentiment"})
    assert answer["model"] == "sentiment" and answer["object"] == "classify"
    assert answer["data"] == named["data"] and len(answer["data"]) == 2
    assert set(answer["usage"]) >= {"prompt_tokens", "total_tokens"}


async def test_infinity_rerank_at_the_root_gives_string_documents_back_as_strings(infinity_box, http) -> None:
    """`rerank.sync(client, body=RerankInput(query=..., documents=[...], return_documents=True))`: its ReRankObject
    types `document` as a string; Cohere's `{"text": ...}` stays at /v1/rerank, where Cohere's clients post."""
    body = {"query": "capital of France", "documents": ["Paris", {"text": "Berlin", "id": 7}, "Banana"],
            "return_documents": True, "raw_scores": False, "model": UNNAMED, "top_n": 5}  # fmt: skip
    status, answer = await post(http, infinity_box, "/rerank", body)
    assert status == 200, answer
    assert answer["model"] == "reranker" and answer["object"] == "rerank"
    sent = body["documents"]
    for result in answer["results"]:
        assert set(result) == {"index", "relevance_score", "document"}
        assert result["document"] == sent[result["index"]]  # a string as the string, an object as sent
    _, cohere = await post(http, infinity_box, "/v1/rerank", {**body, "model": "reranker"})
    assert [r["relevance_score"] for r in cohere["results"]] == [r["relevance_score"] for r in answer["results"]]
    by_index = {r["index"]: r["document"] for r in cohere["results"]}
    assert by_index == {0: {"text": "Paris"}, 1: {"text": "Berlin", "id": 7}, 2: {"text": "Banana"}}


@pytest.mark.parametrize(
    ("path", "body", "model"),
    [("/v1/embeddings", {"input": TEXTS}, DEFAULT_MODEL_NAME), ("/v1/classify", {"input": TEXTS}, "sentiment"),
     ("/v1/rerank", {"query": "capital of France", "documents": ["Paris", "Banana"]}, "reranker"),
     ("/v1/embeddings", {"input": TEXTS, "model": None}, DEFAULT_MODEL_NAME)],
)  # fmt: skip
async def test_a_body_without_a_model_is_the_fleets_one_model_of_its_task(
    infinity_box, http, path, body, model
) -> None:
    """As Infinity's server and TEI read it (tester h96: a 422 for the missing field, where the docs said it was read
    as the fleet's one model); the answer names the model it was."""
    status, answer = await post(http, infinity_box, path, body)
    assert status == 200, answer
    assert answer["model"] == model
    _, named = await post(http, infinity_box, path, {**body, "model": model})
    assert answer.get("data", answer.get("results")) == named.get("data", named.get("results"))


async def test_a_model_left_unnamed_with_two_of_the_task_is_a_422_naming_them(infinity_box, http,
                                                                               classifier_dir) -> None:  # fmt: skip
    status, _ = await post(http, infinity_box, "/v1/models", {"name": "sentiment-2", "path": str(classifier_dir)})
    assert status == 201
    try:
        status, answer = await post(http, infinity_box, "/classify", {"input": TEXTS, "model": UNNAMED})
    finally:
        async with http.delete(url(infinity_box, "/v1/models/sentiment-2")) as response:
            assert response.status == 200, await response.text()
    assert status == 422 and answer["error"]["code"] == "model_required", answer
    message = answer["error"]["message"]
    assert UNNAMED in message and "sentiment" in message and "sentiment-2" in message
    status, answer = await post(http, infinity_box, "/v1/extract", {"input": TEXTS, "model": UNNAMED})
    assert status == 422 and "no entity extractor" in answer["error"]["message"], answer
    status, answer = await post(http, infinity_box, "/v1/extract", {"input": TEXTS})  # no `model` at all: the same
    assert status == 422 and answer["error"]["code"] == "model_required", answer
    assert "`model` is missing" in answer["error"]["message"] and "no entity extractor" in answer["error"]["message"]


@pytest.mark.parametrize("path", ["/models", "/v1/models"])
async def test_the_model_list_carries_stats_the_gateway_has(infinity_box, http, path) -> None:
    """`models.sync(client)`: `ModelInfo.from_dict` pops each record's `id` and `stats` (a KeyError without), and
    reads `owned_by` as its enum of one value, "infinity": at `/models` a record leaves it out."""
    async with http.get(url(infinity_box, path)) as response:
        assert response.status == 200
        answer = await response.json()
    records = {record["id"]: record for record in answer["data"]}
    assert set(records) == {DEFAULT_MODEL_NAME, "sentiment", "reranker"}
    for record in records.values():
        assert record["stats"] == {"batch_size": record["batching"]["max_batch_size"], "waiting_here": 0}
        assert ("owned_by" in record) == (path == "/v1/models")
