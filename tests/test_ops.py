"""Liveness, readiness, metrics and the OpenAPI document."""

from __future__ import annotations

from appliance.app import Box
from tests.conftest import box_settings, noop_model, url


async def test_healthz_and_readyz_when_ready(default_box, http) -> None:
    async with http.get(url(default_box, "/healthz")) as response:
        assert response.status == 200
    async with http.get(url(default_box, "/readyz")) as response:
        assert response.status == 200
        assert (await response.json())["status"] == "ready"


async def test_metrics_expose_the_serving_figures(default_box, http) -> None:
    async with http.post(
        url(default_box, "/v1/embeddings"), json={"input": ["metrics please"], "model": "all-minilm-l6-v2"}
    ) as response:
        assert response.status == 200
    async with http.get(url(default_box, "/metrics")) as response:
        assert response.status == 200
        text = await response.text()
    for name in (
        "fbx_http_requests_total",
        "fbx_queue_ms_bucket",
        "fbx_compute_ms_bucket",
        "fbx_batch_size_bucket",
        "fbx_batch_tokens_bucket",
        "fbx_stream_backlog",
        "fbx_resident_model_bytes",
    ):
        assert name in text, name
    assert 'fbx_http_requests_total{route="/v1/embeddings",status="200"}' in text


async def test_openapi_lists_every_route(default_box, http) -> None:
    async with http.get(url(default_box, "/openapi.json")) as response:
        spec = await response.json()
    assert {"/v1/embeddings", "/v1/models", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])
    assert "EmbeddingRequest" in spec["components"]["schemas"]


async def test_readyz_is_503_with_a_reason_until_the_pinned_model_is_resident(nats_server, http) -> None:
    box = Box(box_settings(nats_server.url, default_model=False, models=[noop_model()]))
    try:
        await box.start()
        async with http.get(url(box, "/readyz")) as response:
            assert response.status == 200
        await box.residency.evict("noop")
        async with http.get(url(box, "/readyz")) as response:
            assert response.status == 503
            assert "noop" in (await response.json())["reason"]
    finally:
        await box.stop()
