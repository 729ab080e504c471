"""The embeddings API against sentence-transformers' own `encode` for the same model folder."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from appliance.app import Box
from appliance.catalog import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME, default_model_path
from tests.conftest import url

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome, everyone should see it at least once this summer.",
    "fleetbox serves a fleet of small models from one process per GPU box",
    "Hi",
    "The cat sits outside " * 40,  # longer than the model's 256 tokens: truncated like encode() does
]


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(default_model_path()), device="cpu")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def embed(http, box: Box, **body) -> dict:
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_vectors_equal_sentence_transformers_encode(default_box, http, reference) -> None:
    result = await embed(http, default_box, input=SENTENCES, model=DEFAULT_MODEL_NAME)
    ours = np.array([item["embedding"] for item in result["data"]], dtype=np.float32)
    expected = reference.encode(SENTENCES)  # the folder's modules.json normalises
    assert [item["index"] for item in result["data"]] == list(range(len(SENTENCES)))
    assert cosines(ours, expected).min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert result["object"] == "list" and result["model"] == DEFAULT_MODEL_NAME


async def test_usage_counts_real_tokens(default_box, http, reference) -> None:
    result = await embed(http, default_box, input=SENTENCES, model=DEFAULT_MODEL_ALIAS)
    tokenizer = reference.tokenizer
    expected = sum(len(tokenizer(text, truncation=True, max_length=256)["input_ids"]) for text in SENTENCES)
    assert result["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


async def test_single_string_input_gives_one_vector(default_box, http, reference) -> None:
    result = await embed(http, default_box, input="Hello there", model=DEFAULT_MODEL_ALIAS)
    assert len(result["data"]) == 1
    ours = np.array([result["data"][0]["embedding"]], dtype=np.float32)
    assert cosines(ours, reference.encode(["Hello there"])).min() >= 0.9999


async def test_base64_is_little_endian_float32_of_the_same_vectors(default_box, http) -> None:
    floats = await embed(http, default_box, input=SENTENCES[:3], model=DEFAULT_MODEL_ALIAS)
    packed = await embed(http, default_box, input=SENTENCES[:3], model=DEFAULT_MODEL_ALIAS, encoding_format="base64")
    for plain, encoded in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        assert np.allclose(decoded, np.array(plain["embedding"], dtype=np.float32), atol=1e-6)


async def test_dimensions_truncate_then_renormalise(default_box, http, reference) -> None:
    result = await embed(http, default_box, input=SENTENCES[:3], model=DEFAULT_MODEL_ALIAS, dimensions=64)
    ours = np.array([item["embedding"] for item in result["data"]], dtype=np.float32)
    full = reference.encode(SENTENCES[:3])[:, :64]
    expected = full / np.linalg.norm(full, axis=1, keepdims=True)
    assert ours.shape == (3, 64)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert cosines(ours, expected).min() >= 0.9999


async def test_openai_sdk_client_works_unchanged(default_box, reference) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url(default_box, "/v1"), api_key="unused", max_retries=0)
    try:
        response = await client.embeddings.create(model=DEFAULT_MODEL_ALIAS, input=SENTENCES[:2])
    finally:
        await client.close()
    ours = np.array([d.embedding for d in response.data], dtype=np.float32)  # the SDK asks for base64
    assert cosines(ours, reference.encode(SENTENCES[:2])).min() >= 0.9999
    assert response.usage.prompt_tokens > 0


async def test_models_list_shows_the_default_model_resident(default_box, http) -> None:
    async with http.get(url(default_box, "/v1/models")) as response:
        body = await response.json()
    (model,) = [m for m in body["data"] if m["id"] == DEFAULT_MODEL_NAME]
    assert model["state"] == "resident" and model["pinned"] is True
    assert model["aliases"] == [DEFAULT_MODEL_ALIAS]
    assert model["bytes"] > 80_000_000  # ~90 MB of fp32 weights plus the warm-up peak
