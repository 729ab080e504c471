"""A TEI base URL per model (`/tei/{name}`) on a fleet of many models: huggingface_hub's `InferenceClient` given
that URL as its model runs `feature_extraction` and `text_classification` against that model, answered as
`/v1/embeddings` and `/v1/classify` answer for it; a body naming another model is refused."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from appliance.app import Box
from appliance.catalog import DEFAULT_MODEL_NAME
from runtimes import Task
from tests.conftest import box_with_models, url
from tests.models import CLASS_LABELS

TEXT = "The weather in Berlin is fine today."


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory, encoder_dir, classifier_dir, cross_encoder_dir) -> AsyncIterator[Box]:
    """Two embedders (the packaged one, whose name holds a `/`, and a bare encoder), a classifier and a reranker."""
    models = {"bare-encoder": encoder_dir, "sentiment": classifier_dir, "scorer": cross_encoder_dir}
    async with box_with_models(tmp_path_factory, "tei-fleet", models) as (box, _):
        yield box


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import AsyncInferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's guard against the hub; this is a local box
    return AsyncInferenceClient


async def post(http, box: Box, path: str, body: object) -> tuple[int, object]:
    async with http.post(url(box, path), json=body) as response:
        return response.status, await response.json()


@pytest.mark.parametrize("name", [DEFAULT_MODEL_NAME, "bare-encoder"])
async def test_feature_extraction_at_a_models_tei_url_embeds_with_that_model(fleet, http, hub, name) -> None:
    vectors = np.asarray(await hub(model=url(fleet, f"/tei/{name}")).feature_extraction(TEXT), dtype=np.float32)
    _, expected = await post(http, fleet, "/v1/embeddings", {"model": name, "input": [TEXT]})
    np.testing.assert_allclose(vectors.reshape(-1), expected["data"][0]["embedding"], atol=1e-6)
    status, embedded = await post(http, fleet, f"/tei/{name}/embed", {"inputs": [TEXT]})
    assert status == 200, embedded
    np.testing.assert_allclose(np.asarray(embedded[0]), vectors.reshape(-1), atol=1e-6)


async def test_text_classification_at_a_models_tei_url_honours_top_k(fleet, http, hub) -> None:
    """huggingface_hub reads TEI's answer to one input (a flat list of labels) as a batch and returns its first
    item: the best label, as against a TEI server. Its `parameters` are honoured: `top_k`, and
    `function_to_apply="none"` as the logits (checked on the wire at /tei/sentiment/predict)."""
    client = hub(model=url(fleet, "/tei/sentiment"))
    best = await client.text_classification(TEXT)
    _, expected = await post(http, fleet, "/v1/classify", {"model": "sentiment", "input": TEXT})
    assert best["label"] == expected["data"][0][0]["label"]
    assert best["score"] == pytest.approx(expected["data"][0][0]["score"], abs=1e-5)
    logit = await client.text_classification(TEXT, function_to_apply="none")
    _, raw = await post(http, fleet, "/v1/classify", {"model": "sentiment", "input": TEXT, "raw_scores": True})
    assert logit["score"] == pytest.approx(raw["data"][0][0]["score"], abs=1e-5)
    status, top = await post(http, fleet, "/tei/sentiment/predict", {"inputs": TEXT, "parameters": {"top_k": 2}})
    assert status == 200, top
    assert [item["label"] for item in top] == [item["label"] for item in expected["data"][0][:2]]
    _, logits = await post(http, fleet, "/tei/sentiment", {"inputs": TEXT, "parameters": {"function_to_apply": "none"}})
    assert [item["score"] for item in logits] == pytest.approx([item["score"] for item in raw["data"][0]], abs=1e-5)
    # The squash of transformers' pipeline, chosen (tester h121: "softmax", what the model does anyway, was a 422).
    by_label = {item["label"]: item["score"] for item in raw["data"][0]}
    labels, values = list(by_label), np.asarray(list(by_label.values()), dtype=np.float64)
    softmax = np.exp(values - values.max()) / np.exp(values - values.max()).sum()
    for squash, expected_scores in (("softmax", softmax), ("sigmoid", 1 / (1 + np.exp(-values)))):
        status, got = await post(
            http, fleet, "/tei/sentiment", {"inputs": TEXT, "parameters": {"function_to_apply": squash}}
        )
        assert status == 200, got
        assert {item["label"]: item["score"] for item in got} == pytest.approx(
            dict(zip(labels, expected_scores, strict=True)), abs=1e-5
        )
        assert [item["score"] for item in got] == sorted((item["score"] for item in got), reverse=True)
    assert (await client.text_classification(TEXT, function_to_apply="softmax"))["score"] == pytest.approx(
        best["score"]
    )
    both = {"model": "sentiment", "input": TEXT, "raw_scores": True, "function_to_apply": "sigmoid"}
    status, refused = await post(http, fleet, "/v1/classify", both)  # logits, or their sigmoid: not both
    assert (status, refused["error"]["code"]) == (422, "invalid_input"), refused
    # At /predict the choice is `parameters.function_to_apply`, and the 422 names it so (review h141).
    both = {"inputs": TEXT, "raw_scores": True, "parameters": {"function_to_apply": "softmax"}}
    status, refused = await post(http, fleet, "/tei/sentiment", both)
    assert (status, refused["error"]["code"]) == (422, "invalid_input"), refused
    assert "`parameters.function_to_apply` 'softmax'" in refused["error"]["message"], refused


@pytest.mark.parametrize("name", [DEFAULT_MODEL_NAME, "bare-encoder"])
async def test_sentence_similarity_at_a_models_tei_url_is_the_cosine_of_its_embeddings(fleet, http, hub, name) -> None:
    """huggingface_hub posts `{"inputs": {"source_sentence", "sentences"}}` to the model's URL (TEI's `POST /`); TEI's
    `/similarity` takes the same body: the cosines of the model's vectors, in the sentences' order."""
    others = ["It is sunny in Berlin.", "Stock prices fell sharply.", TEXT]
    scores = await hub(model=url(fleet, f"/tei/{name}")).sentence_similarity(TEXT, other_sentences=others)
    _, embedded = await post(http, fleet, "/v1/embeddings", {"model": name, "input": [TEXT, *others]})
    vectors = np.asarray([item["embedding"] for item in embedded["data"]], dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    expected = vectors[1:] @ vectors[0]
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert scores[2] == pytest.approx(1.0, abs=1e-5)
    if name == DEFAULT_MODEL_NAME:  # real weights: sunny Berlin is nearer than stock prices
        assert scores[0] > scores[1] + 0.2, scores
    body = {"inputs": {"source_sentence": TEXT, "sentences": others}, "parameters": {"truncate": True}}
    for path, sent in ((f"/tei/{name}/similarity", body), ("/similarity", {**body, "model": name})):
        status, answer = await post(http, fleet, path, sent)
        assert status == 200, (path, answer)
        np.testing.assert_allclose(answer, expected, atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "code", "names"),
    [
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, "model_required", "bare-encoder"),
        ("/tei/sentiment", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, "wrong_task", "/v1/classify"),
        ("/tei/bare-encoder/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, "invalid_input",
         "sentences"),
        ("/tei/bare-encoder", {"inputs": {"source_sentence": "", "sentences": ["b"]}}, "invalid_input",
         "source_sentence"),
        ("/tei/bare-encoder/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]},
         "parameters": {"prompt_name": "query"}}, "unsupported_parameter", "prompt_name"),
        ("/tei/bare-encoder/similarity", {"inputs": ["a", "b"]}, "invalid_input", "inputs"),
    ],
)  # fmt: skip
async def test_similarity_refusals_say_what_to_change(fleet, http, path, body, code, names) -> None:
    status, answer = await post(http, fleet, path, body)
    assert (status, answer["error"]["code"]) == (422, code), answer
    assert names in answer["error"]["message"], answer


async def test_too_many_sentences_are_counted_as_the_client_sent_them(fleet, http) -> None:
    """Review r50: the source sentence is an input too; the 413 counted it among the sentences."""
    limit = fleet.settings.max_inputs
    body = {"inputs": {"source_sentence": "a", "sentences": ["b"] * limit}}
    status, answer = await post(http, fleet, "/tei/bare-encoder/similarity", body)
    assert (status, answer["error"]["code"]) == (413, "too_many_inputs"), answer
    assert answer["error"]["message"].startswith(f"{limit} sentences is more than the limit of {limit - 1}"), answer


async def test_an_over_long_sentence_is_named_as_the_client_sent_it(fleet, http) -> None:
    """Tester h96: with `"truncate": false` the 413 named the inputs as queued (`input 1` for `sentences[0]`, the
    source sentence being input 0)."""
    long = " ".join(["word"] * 600)
    for sentences, named in ((["short", long], "sentences[1]"), (["short"], "source_sentence")):
        source = long if named == "source_sentence" else "short"
        body = {"inputs": {"source_sentence": source, "sentences": sentences}, "parameters": {"truncate": False}}
        status, answer = await post(http, fleet, "/tei/bare-encoder/similarity", body)
        assert (status, answer["error"]["code"]) == (413, "input_too_long"), answer
        assert answer["error"]["message"].startswith(f"{named} is longer than the model's maximum"), answer


async def test_info_at_a_models_tei_url_describes_that_model(fleet, http, hub) -> None:
    info = await hub(model=url(fleet, "/tei/sentiment"), provider="hf-inference").get_endpoint_info()
    assert info["model_id"] == "sentiment"
    assert info["model_type"] == {
        "classifier": {
            "id2label": {str(i): label for i, label in enumerate(CLASS_LABELS)},
            "label2id": {label: i for i, label in enumerate(CLASS_LABELS)},
        }
    }
    async with http.get(url(fleet, f"/tei/{DEFAULT_MODEL_NAME}/info")) as response:
        assert response.status == 200
        assert (await response.json())["model_type"] == {"embedding": {"pooling": "mean"}}


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "names"),
    [
        ("/tei/sentiment", {"inputs": "x", "model": "bare-encoder"}, 422, "model_mismatch", "bare-encoder"),
        ("/tei/bare-encoder/embed", {"inputs": "x", "model": "sentiment"}, 422, "model_mismatch", "/tei/bare-encoder"),
        ("/tei/nothing", {"inputs": "x"}, 404, "model_not_found", "nothing"),
        ("/tei/sentiment/embed", {"inputs": "x"}, 422, "wrong_task", "/v1/classify"),
        ("/tei/sentiment", {"inputs": "x", "parameters": {"function_to_apply": "tanh"}}, 422,
         "invalid_input", "function_to_apply"),
        ("/tei/sentiment/rerank", {"query": "q", "documents": ["a"]}, 422, "invalid_input", "`texts`"),
        # a classification client at a reranker's URL: told of the path it called (it was `/tei/scorer/rerank`)
        ("/tei/scorer", {"inputs": "x"}, 422, "invalid_input", "/tei/scorer takes TEI's rerank"),
    ],
)  # fmt: skip
async def test_a_models_tei_url_refuses_what_it_cannot_serve(fleet, http, path, body, status, code, names) -> None:
    got, answer = await post(http, fleet, path, body)
    assert got == status, answer
    assert answer["error"]["code"] == code
    assert names in answer["error"]["message"], answer


async def test_a_body_naming_the_urls_model_by_alias_is_served(fleet, http) -> None:
    status, answer = await post(http, fleet, f"/tei/{DEFAULT_MODEL_NAME}", {"inputs": "x", "model": "all-minilm-l6-v2"})
    assert status == 200 and len(answer[0]) == 384, answer


@pytest.mark.parametrize("name", ["sentiment", DEFAULT_MODEL_NAME])
async def test_health_check_at_a_models_tei_url_is_the_boxs_readiness(fleet, http, hub, name) -> None:
    """huggingface_hub's `health_check` asks `GET {url}/health` of the client's URL: a model's TEI URL answered 405,
    so it was always false (tester h96)."""
    assert await hub(model=url(fleet, f"/tei/{name}"), provider="hf-inference").health_check() is True
    async with http.get(url(fleet, "/tei/nothing/health")) as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("POST", "/tei/sentiment/info", "GET,HEAD"), ("POST", "/tei/sentiment/health", "GET,HEAD"),
     ("GET", "/tei/sentiment/embed", "POST"), ("POST", f"/tei/{DEFAULT_MODEL_NAME}/info", "GET,HEAD")],
)  # fmt: skip
async def test_a_models_tei_route_asked_with_the_wrong_method_is_a_405(fleet, http, method, path, allowed) -> None:
    """`POST /tei/{name}/info` was a 404 for a model called `{name}/info` (tester h96)."""
    async with http.request(method, url(fleet, path), json={"inputs": "x"}) as response:
        assert response.status == 405, await response.text()
        assert response.headers["Allow"] == allowed
        assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_a_tei_route_whose_slash_is_escaped_is_a_404_not_a_405_allowing_its_own_method(fleet, http) -> None:
    """`POST /tei/sentiment%2Fpredict`: aiohttp keeps an escaped `/` inside the name, so the bare route took it and
    told a POST "allowed: POST" (tester h121). It names a model that does not exist, and the route it meant."""
    async with http.post(url(fleet, "/tei/sentiment%2Fpredict"), json={"inputs": "x"}) as response:
        assert response.status == 404, await response.text()
        message = (await response.json())["error"]["message"]
    assert "'sentiment/predict' does not exist" in message and "/tei/sentiment/predict" in message


async def test_info_at_an_adapters_tei_url_reads_its_bases_folder(fleet, http, adapter_dirs) -> None:
    """An adapter runs with its base's tokenizer, labels and length: its info said null for each (tester h96)."""
    registration = {"name": "sentiment:tuned", "path": str(adapter_dirs[Task.CLASSIFY]), "adapter_of": "sentiment"}
    async with http.post(url(fleet, "/v1/models"), json=registration) as response:
        assert response.status == 201, await response.text()
    try:
        async with http.get(url(fleet, "/tei/sentiment/info")) as response:
            base = await response.json()
        async with http.get(url(fleet, "/tei/sentiment:tuned/info")) as response:
            assert response.status == 200
            info = await response.json()
        assert info["model_id"] == "sentiment:tuned"
        assert info["max_input_length"] == base["max_input_length"] is not None
        assert info["model_type"] == base["model_type"]
        assert info["model_type"]["classifier"]["id2label"] == {str(i): label for i, label in enumerate(CLASS_LABELS)}
    finally:
        async with http.delete(url(fleet, "/v1/models/sentiment:tuned")) as response:
            assert response.status == 200


async def test_openapi_lists_a_models_tei_health_and_the_bodies_its_root_takes(fleet, http) -> None:
    async with http.get(url(fleet, "/openapi.json")) as response:
        paths = (await response.json())["paths"]
    assert "503" in paths["/tei/{name}/health"]["get"]["responses"]
    assert "oneOf" in paths["/tei/{name}"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # A model read counts toward a key's concurrent requests (FBX_MAX_CONCURRENT_PER_KEY): it may be a 429.
    assert "429" in paths["/v1/models"]["get"]["responses"]
    assert "429" in paths["/v1/models/{name}"]["get"]["responses"]
    assert "417" in paths["/v1/embeddings"]["post"]["responses"]
