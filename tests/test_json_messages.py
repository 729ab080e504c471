"""A body that is not JSON is named once as such: the 400's message says what is wrong with it, and where."""

from __future__ import annotations

import pytest

from tests.conftest import url


@pytest.mark.parametrize(
    ("body", "fault"),
    [
        (rb'{"model": "x", "prompt": "\ud800\u0041"}', "invalid utf-16 surrogate pair"),
        (b'{"model" "x"}', "expected ':'"),
    ],
)
async def test_malformed_json_is_named_once(default_box, http, body: bytes, fault: str) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.post(url(default_box, "/v1/completions"), data=body, headers=headers) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["code"] == "invalid_json"
    assert error["message"].startswith(f"malformed JSON: {fault}"), error["message"]
    assert error["message"].lower().count("malformed") == 1, error["message"]
