"""Everything a client can get wrong is a clear 4xx in the error shape, and the box keeps serving."""

from __future__ import annotations

import pytest

from appliance.catalog import DEFAULT_MODEL_NAME
from tests.conftest import url

JSON = {"Content-Type": "application/json"}


async def post(http, box, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    async with http.post(url(box, "/v1/embeddings"), data=body, headers=headers or JSON) as response:
        return response.status, await response.json(), dict(response.headers)


def assert_error_shape(body: dict, code: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b'{"input": [], "model": "all-minilm-l6-v2"}', 422, "empty_input"),
        (b'{"input": "", "model": "all-minilm-l6-v2"}', 422, "empty_input"),
        (b'{"input": ["ok", ""], "model": "all-minilm-l6-v2"}', 422, "empty_input"),
        (b'{"input": ["ok", 3], "model": "all-minilm-l6-v2"}', 422, "invalid_input"),
        (b'{"input": [[1, 2]], "model": "all-minilm-l6-v2"}', 422, "invalid_input"),
        (b'{"model": "all-minilm-l6-v2"}', 422, "invalid_input"),
        (b'{"input": "x"}', 422, "invalid_input"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "encoding_format": "int8"}', 422, "invalid_input"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "dimensions": 0}', 422, "invalid_input"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "dimensions": 1000}', 422, "invalid_dimensions"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "timeout": -1}', 422, "invalid_input"),
        (b"[1, 2, 3]", 422, "invalid_input"),
    ],
)
async def test_bad_bodies_get_clear_client_errors(default_box, http, body, status, code) -> None:
    got, payload, _ = await post(http, default_box, body)
    assert got == status, payload
    assert_error_shape(payload, code)


async def test_unknown_model_is_404_naming_the_models_that_exist(default_box, http) -> None:
    status, payload, _ = await post(http, default_box, b'{"input": "x", "model": "gpt-17"}')
    assert status == 404
    assert_error_shape(payload, "model_not_found")
    assert "gpt-17" in payload["error"]["message"] and DEFAULT_MODEL_NAME in payload["error"]["message"]


async def test_wrong_content_type_is_415(default_box, http) -> None:
    status, payload, _ = await post(
        http, default_box, b'{"input": "x", "model": "all-minilm-l6-v2"}', {"Content-Type": "text/plain"}
    )
    assert status == 415
    assert_error_shape(payload, "unsupported_media_type")


async def test_more_inputs_than_max_inputs_is_413(default_box, http) -> None:
    limit = default_box.settings.max_inputs
    body = b'{"model": "all-minilm-l6-v2", "input": [' + b",".join([b'"a"'] * (limit + 1)) + b"]}"
    status, payload, _ = await post(http, default_box, body)
    assert status == 413
    assert_error_shape(payload, "too_many_inputs")


async def test_body_over_max_body_bytes_is_413(default_box, http) -> None:
    filler = b"a" * (default_box.settings.max_body_bytes + 1024)
    body = b'{"model": "all-minilm-l6-v2", "input": "' + filler + b'"}'
    status, payload, _ = await post(http, default_box, body)
    assert status == 413
    assert_error_shape(payload)


async def test_too_long_input_without_truncation_is_413(default_box, http) -> None:
    text = "word " * 400
    body = f'{{"model": "all-minilm-l6-v2", "input": ["short", "{text}"], "truncate": false}}'.encode()
    status, payload, _ = await post(http, default_box, body)
    assert status == 413
    assert_error_shape(payload, "input_too_long")
    assert "input 1" in payload["error"]["message"] and "256" in payload["error"]["message"]


async def test_too_long_input_is_truncated_by_default(default_box, http) -> None:
    body = f'{{"model": "all-minilm-l6-v2", "input": "{"word " * 400}"}}'.encode()
    status, payload, _ = await post(http, default_box, body)
    assert status == 200
    assert payload["usage"]["prompt_tokens"] == 256


async def test_unknown_route_and_wrong_method_use_the_error_shape(default_box, http) -> None:
    async with http.get(url(default_box, "/v1/nothing-here")) as response:
        assert response.status == 404
        assert_error_shape(await response.json(), "route_not_found")
    async with http.get(url(default_box, "/v1/embeddings")) as response:
        assert response.status == 405
        assert_error_shape(await response.json(), "method_not_allowed")


async def test_bad_timeout_header_is_400(default_box, http) -> None:
    headers = {**JSON, "Timeout": "soon"}
    status, payload, _ = await post(http, default_box, b'{"input": "x", "model": "all-minilm-l6-v2"}', headers)
    assert status == 400
    assert_error_shape(payload)


async def test_passed_deadline_is_504_with_a_clear_message(default_box, http) -> None:
    status, payload, _ = await post(
        http, default_box, b'{"input": "x", "model": "all-minilm-l6-v2", "timeout": 0.0005}'
    )
    assert status == 504
    assert_error_shape(payload, "deadline_exceeded")
    assert "deadline" in payload["error"]["message"]


async def test_box_still_serves_after_every_bad_request(default_box, http) -> None:
    status, payload, _ = await post(http, default_box, b'{"input": ["still here"], "model": "all-minilm-l6-v2"}')
    assert status == 200
    assert len(payload["data"][0]["embedding"]) == 384
    async with http.get(url(default_box, "/metrics")) as response:
        text = await response.text()
    assert 'fbx_http_requests_total{route="/v1/embeddings",status="500"}' not in text
