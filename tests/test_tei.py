"""TEI's `/embed` and `/predict` on a real box: TEI's request and answer shapes, computed exactly as `/v1/embeddings`
and `/v1/classify` compute them (the same queue, worker and pooling), `model` optional where the fleet has one model
of the task, and every option fleetbox cannot honour refused by name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

import appliance
from appliance.app import Box
from appliance.build import build_id
from appliance.catalog import DEFAULT_MODEL_NAME, default_model_path
from tests.conftest import box_settings, box_with_models, start_nats, url
from tests.models import CLASS_LABELS

TEXTS = ["A man is eating food.", "The weather in Berlin is fine today.", "Hi"]


@pytest.fixture(scope="module")
async def tei_box(tmp_path_factory, classifier_dir) -> AsyncIterator[Box]:
    """One box with the packaged embedder and one classifier, `sentiment`, registered over HTTP."""
    async with box_with_models(tmp_path_factory, "tei-box", {"sentiment": classifier_dir}) as (box, _):
        yield box


@pytest.fixture(scope="module")
def pooled_only() -> SentenceTransformer:
    """The packaged model's folder without its Normalize module: TEI's `normalize: false`."""
    full = SentenceTransformer(str(default_model_path()), device="cpu")
    return SentenceTransformer(modules=[full[0], full[1]], device="cpu")


async def post(http, box: Box, path: str, body: object) -> tuple[int, object]:
    async with http.post(url(box, path), json=body) as response:
        return response.status, await response.json()


async def openai_vectors(http, box: Box, **body) -> np.ndarray:
    status, answer = await post(http, box, "/v1/embeddings", {"model": DEFAULT_MODEL_NAME, **body})
    assert status == 200, answer
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


# -- /embed ----------------------------------------------------------------------------------------


async def test_embed_answers_a_bare_list_of_the_same_vectors_as_v1_embeddings(tei_box, http) -> None:
    status, answer = await post(http, tei_box, "/embed", {"inputs": TEXTS})  # no model: the fleet's one embedder
    assert status == 200, answer
    assert isinstance(answer, list) and len(answer) == len(TEXTS)
    assert all(isinstance(row, list) and len(row) == 384 and all(isinstance(x, float) for x in row) for row in answer)
    np.testing.assert_array_equal(np.array(answer, dtype=np.float32), await openai_vectors(http, tei_box, input=TEXTS))
    status, one = await post(http, tei_box, "/embed", {"inputs": "Hi", "model": DEFAULT_MODEL_NAME})
    assert status == 200 and len(one) == 1 and np.allclose(one[0], answer[2], atol=1e-6)


async def test_embed_normalize_false_gives_the_pooled_vectors(tei_box, http, pooled_only) -> None:
    status, answer = await post(http, tei_box, "/embed", {"inputs": TEXTS, "normalize": False})
    assert status == 200, answer
    raw = np.array(answer, dtype=np.float32)
    norms = np.linalg.norm(raw, axis=1)
    assert not np.allclose(norms, 1.0, atol=1e-2)
    np.testing.assert_allclose(raw, pooled_only.encode(TEXTS), atol=1e-4)
    unit = await openai_vectors(http, tei_box, input=TEXTS)
    np.testing.assert_allclose(raw / norms[:, None], unit, atol=1e-5)
    # The same switch on /v1/embeddings, and the default there is the folder's (unit) vectors.
    np.testing.assert_allclose(await openai_vectors(http, tei_box, input=TEXTS, normalize=False), raw, atol=1e-6)


async def test_embed_dimensions_cut_as_v1_embeddings_does(tei_box, http) -> None:
    status, answer = await post(http, tei_box, "/embed", {"inputs": TEXTS, "dimensions": 64})
    assert status == 200, answer
    cut = np.array(answer, dtype=np.float32)
    assert cut.shape == (3, 64)
    np.testing.assert_array_equal(cut, await openai_vectors(http, tei_box, input=TEXTS, dimensions=64))
    status, raw = await post(http, tei_box, "/embed", {"inputs": TEXTS, "dimensions": 64, "normalize": False})
    _, full = await post(http, tei_box, "/embed", {"inputs": TEXTS, "normalize": False})
    np.testing.assert_allclose(np.array(raw), np.array(full)[:, :64], atol=1e-6)  # cut, not re-normalised


# -- /predict --------------------------------------------------------------------------------------


def assert_same_predictions(got: list, want: list) -> None:
    """Labels in the same order, scores equal to float noise (a batch pads its rows to another length)."""
    assert [p["label"] for p in got] == [p["label"] for p in want]
    assert [p["score"] for p in got] == pytest.approx([p["score"] for p in want], abs=1e-5)


async def test_predict_gives_v1_classify_scores_one_list_or_one_per_input(tei_box, http) -> None:
    _, classify = await post(http, tei_box, "/v1/classify", {"model": "sentiment", "input": TEXTS})
    status, batch = await post(http, tei_box, "/predict", {"inputs": [[text] for text in TEXTS]})
    assert status == 200, batch
    assert len(batch) == len(TEXTS)
    for got, want in zip(batch, classify["data"], strict=True):
        assert_same_predictions(got, want)
    assert all(set(p) == {"label", "score"} and p["label"] in CLASS_LABELS for row in batch for p in row)
    for single in (TEXTS[0], [TEXTS[0]]):  # TEI's one input: a string, or a one-string list
        status, answer = await post(http, tei_box, "/predict", {"inputs": single, "model": "sentiment"})
        assert status == 200, answer
        assert_same_predictions(answer, classify["data"][0])


async def test_predict_raw_scores_are_the_logits(tei_box, http) -> None:
    _, raw = await post(http, tei_box, "/predict", {"inputs": TEXTS[1], "raw_scores": True})
    _, classify = await post(http, tei_box, "/v1/classify", {"model": "sentiment", "input": TEXTS[1],
                                                              "raw_scores": True})  # fmt: skip
    assert_same_predictions(raw, classify["data"][0])
    _, probabilities = await post(http, tei_box, "/predict", {"inputs": TEXTS[1]})
    logits = np.array([p["score"] for p in raw])
    softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert [p["score"] for p in probabilities] == pytest.approx(softmax.tolist(), abs=1e-5)


# -- model omitted ---------------------------------------------------------------------------------


async def test_a_missing_model_with_two_of_the_task_is_a_422_naming_them(tei_box, http, classifier_dir) -> None:
    status, _ = await post(http, tei_box, "/v1/models", {"name": "sentiment-2", "path": str(classifier_dir)})
    assert status == 201
    try:
        status, answer = await post(http, tei_box, "/predict", {"inputs": "x"})
        assert status == 422, answer
        assert answer["error"]["code"] == "model_required"
        assert "2 classifiers" in answer["error"]["message"]
        assert "sentiment" in answer["error"]["message"] and "sentiment-2" in answer["error"]["message"]
        status, answer = await post(http, tei_box, "/predict", {"inputs": "x", "model": "sentiment-2"})
        assert status == 200, answer
    finally:
        async with http.delete(url(tei_box, "/v1/models/sentiment-2")) as response:
            assert response.status == 200, await response.text()
    status, answer = await post(http, tei_box, "/rerank", {"query": "q", "texts": ["a"]})  # no reranker at all
    assert status == 422 and answer["error"]["code"] == "model_required"
    assert "no reranker" in answer["error"]["message"]


# -- POST / (and /invocations): the route of the model's task ------------------------------------------


@pytest.mark.parametrize("path", ["/", "/invocations"])
async def test_post_at_the_root_is_the_route_of_the_named_models_task(tei_box, http, path) -> None:
    """A TEI server serves its one model's route at `POST /` too: huggingface_hub's InferenceClient posts there."""
    status, vectors = await post(http, tei_box, path, {"inputs": TEXTS, "model": DEFAULT_MODEL_NAME})
    assert status == 200, vectors
    _, expected = await post(http, tei_box, "/embed", {"inputs": TEXTS})
    assert vectors == expected
    status, labels = await post(http, tei_box, path, {"inputs": "a fine film", "model": "sentiment"})
    assert status == 200, labels
    _, expected = await post(http, tei_box, "/predict", {"inputs": "a fine film"})
    assert labels == expected
    status, answer = await post(http, tei_box, path, {"inputs": "x"})  # an embedder and a classifier: which?
    assert status == 422 and answer["error"]["code"] == "model_required", answer
    assert "classifiers and embedding models" in answer["error"]["message"]
    assert "/embed, /predict or /rerank" in answer["error"]["message"]


async def test_huggingface_hubs_inference_client_is_answered_at_a_tei_base_url(tmp_path, monkeypatch) -> None:
    """The stock client of TEI users: `InferenceClient(base_url=...)` posts `feature_extraction` to `POST /`, with
    `normalize` (a fleet of one embedder, as a TEI server is)."""
    from huggingface_hub import AsyncInferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's guard against the hub; this is a local box

    server = await start_nats(tmp_path / "nats")
    box = Box(box_settings(server.url, box_id="tei-hub"))
    await box.start()
    try:
        client = AsyncInferenceClient(base_url=url(box, ""))
        vectors = np.asarray(await client.feature_extraction(TEXTS[0]), dtype=np.float32)
        raw = np.asarray(await client.feature_extraction(TEXTS[0], normalize=False), dtype=np.float32)
        async with aiohttp.ClientSession() as http:
            expected = await openai_vectors(http, box, input=[TEXTS[0]])
    finally:
        await box.stop()
        await server.stop()
    np.testing.assert_allclose(vectors.reshape(-1), expected[0], atol=1e-6)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 0.1  # pooled, not normalised
    np.testing.assert_allclose(raw.reshape(-1) / np.linalg.norm(raw), expected[0], atol=1e-5)


# -- GET /info ------------------------------------------------------------------------------------


async def test_info_describes_the_fleets_one_model_as_huggingface_hub_reads_it(tmp_path, monkeypatch) -> None:
    """`InferenceClient(model=URL).get_endpoint_info()` (here its async twin) reads TEI's `GET /info`: filled from
    the catalog, the settings and the model's folder (all-MiniLM-L6-v2: mean pooling, 256 tokens)."""
    from huggingface_hub import AsyncInferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's guard against the hub; this is a local box

    server = await start_nats(tmp_path / "nats")
    box = Box(box_settings(server.url, box_id="tei-info", max_inputs=64, max_waiting=100))
    await box.start()
    try:
        # A TEI endpoint is `hf-inference` to the client (its default provider, None here, refuses the call).
        client = AsyncInferenceClient(model=url(box, ""), provider="hf-inference")
        info = await client.get_endpoint_info()
    finally:
        await box.stop()
        await server.stop()
    batching = box.catalog.batching_for(box.catalog.get(DEFAULT_MODEL_NAME))
    assert info == {
        "model_id": DEFAULT_MODEL_NAME,
        "model_sha": None,
        "model_dtype": "float32",
        "model_type": {"embedding": {"pooling": "mean"}},
        "served_model_name": DEFAULT_MODEL_NAME,
        "max_concurrent_requests": 100,
        "max_input_length": 256,
        "max_batch_tokens": batching.max_batch_tokens,
        "max_batch_requests": batching.max_batch_size,
        "max_client_batch_size": 64,
        "auto_truncate": True,
        "tokenization_workers": None,
        "version": appliance.__version__,
        "sha": build_id(),
        "docker_label": None,
    }


async def test_info_on_a_fleet_of_two_encoder_models_is_a_422_naming_them(tei_box, http) -> None:
    async with http.get(url(tei_box, "/info")) as response:
        assert response.status == 422
        answer = await response.json()
    assert answer["error"]["code"] == "model_required"
    assert DEFAULT_MODEL_NAME in answer["error"]["message"] and "sentiment" in answer["error"]["message"]


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "names"),
    [
        ("/embed", {"inputs": []}, 422, "empty_input", "`inputs` is empty"),  # as sent: `input` was fleetbox's
        ("/embed", {"inputs": ""}, 422, "empty_input", "input 0"),
        ("/embed", {"inputs": ["ok", ""]}, 422, "empty_input", "input 1"),
        ("/embed", {"inputs": [[101, 3231, 102]]}, 422, "unsupported_parameter", "`inputs` holds token ids"),
        ("/embed", {"inputs": [101, 3231, 102]}, 422, "unsupported_parameter", "`inputs` holds token ids"),
        ("/embed", {"inputs": ["ok", 3]}, 422, "invalid_input", "input 1"),
        # These were told they held token ids (stock-client tester h42).
        ("/embed", {"inputs": [None]}, 422, "invalid_input", "input 0 is not a string"),
        ("/embed", {"inputs": [{}]}, 422, "invalid_input", "input 0 is not a string"),
        ("/", {"inputs": "x", "model": 5}, 422, "invalid_input", "`model` must be a model's name, a string, not 5"),
        ("/embed", {"inputs": "x", "prompt_name": "query"}, 422, "unsupported_parameter", "prompt_name"),
        ("/embed", {"inputs": "x", "truncation_direction": "Left"}, 422, "unsupported_parameter", "at its end only"),
        ("/embed", {"inputs": [["a"], ["b"]]}, 422, "invalid_input", "lists of one string are a /predict batch"),
        ("/embed", {"inputs": "x", "dimensions": 2**64}, 422, "invalid_input", "dimensions"),  # was a 500
        ("/embed", {"inputs": "x", "dimensions": 2**63 - 1}, 422, "invalid_dimensions", "dimensions"),
        ("/embed", {"inputs": "x", "dimensions": 0}, 422, "invalid_input", "dimensions"),
        ("/embed", {"inputs": "x", "dimensions": 100_000}, 422, "invalid_dimensions", "dimensions"),
        ("/embed", {"inputs": "x", "normalize": "yes"}, 422, "invalid_input", "normalize"),
        ("/embed", {"inputs": "x", "timeout": 0}, 422, "invalid_input", "timeout"),
        ("/embed", {"inputs": "x", "model": "sentiment"}, 422, "wrong_task", "/v1/classify"),
        ("/embed", {"inputs": "x", "model": "nothing"}, 404, "model_not_found", "nothing"),
        ("/embed", {"inputs": "word " * 600, "truncate": False}, 413, "input_too_long", "input 0"),
        ("/embed", {"normalize": True}, 422, "invalid_input", "inputs"),
        ("/embed", [1, 2], 422, "invalid_input", None),
        ("/predict", {"inputs": ["a premise", "a hypothesis"]}, 422, "unsupported_parameter", "sentence pair"),
        ("/predict", {"inputs": [["a"], ["a", "b"]]}, 422, "unsupported_parameter", "sentence pair"),
        ("/predict", {"inputs": ["a", "b", "c"]}, 422, "invalid_input", "a batch is a list of lists"),
        ("/predict", {"inputs": [["a"], "b"]}, 422, "invalid_input", "mixes strings and lists"),
        ("/predict", {"inputs": [["a"], []]}, 422, "invalid_input", "`inputs` 1 holds 0 strings"),
        ("/predict", {"inputs": [["a", "b", "c"]]}, 422, "invalid_input", "`inputs` 0 holds 3 strings"),
        ("/predict", {"inputs": [[""]]}, 422, "empty_input", "input 0"),
        ("/predict", {"inputs": []}, 422, "empty_input", "`inputs` is empty"),
        ("/predict", {"inputs": 3}, 422, "invalid_input", "inputs"),
        ("/predict", {"inputs": [[1]]}, 422, "invalid_input", "inputs"),
        ("/predict", {"inputs": "x", "raw_scores": 1}, 422, "invalid_input", "raw_scores"),
        ("/predict", {"inputs": "x", "truncation_direction": "left"}, 422, "unsupported_parameter", "end only"),
        ("/rerank", {"query": "q", "texts": ["a"], "truncation_direction": "left"}, 422, "unsupported_parameter", None),
        ("/", {"inputs": "x", "model": "nothing"}, 404, "model_not_found", "nothing"),
        ("/", {"inputs": "x", "model": DEFAULT_MODEL_NAME, "dimensions": 2**64}, 422, "invalid_input", "dimensions"),
        ("/", "x", 422, "invalid_input", None),
        ("/predict", {"inputs": "x", "model": DEFAULT_MODEL_NAME}, 422, "wrong_task", "/v1/embeddings"),
        ("/predict", {"inputs": "word " * 600, "truncate": False}, 413, "input_too_long", "input 0"),
        ("/predict", "x", 422, "invalid_input", None),
    ],
)
async def test_bad_tei_requests_are_clear_4xx(tei_box, http, path, body, status, code, names) -> None:
    got, answer = await post(http, tei_box, path, body)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "code"}  # fleetbox's error shape, not TEI's
    assert answer["error"]["code"] == code
    if names is not None:
        assert names in answer["error"]["message"], answer


async def test_openapi_lists_embed_and_predict_with_their_schemas(tei_box, http) -> None:
    async with http.get(url(tei_box, "/openapi.json")) as response:
        spec = await response.json()
    for path, schema in (("/embed", "TeiEmbedRequest"), ("/predict", "TeiPredictRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{schema}"}
    embed = spec["components"]["schemas"]["TeiEmbedRequest"]["properties"]
    assert {"inputs", "model", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions"} <= set(
        embed
    )
    assert {"inputs", "raw_scores", "truncate"} <= set(spec["components"]["schemas"]["TeiPredictRequest"]["properties"])
