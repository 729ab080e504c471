"""Keys and limits: per-key concurrency answers 429, /metrics can be protected, keys are never logged."""

from __future__ import annotations

import asyncio
import logging

from appliance.logs import MalformedHttpFilter
from tests.conftest import noop_model, url

USER = {"Authorization": "Bearer user-key"}


async def test_too_many_requests_in_flight_for_one_key_is_429(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model(cost_ms=300)], api_keys="user-key",
                          max_concurrent_per_key=2, max_batch_size=1)  # fmt: skip
    results = await asyncio.gather(
        *(
            http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"r{i}"}, headers=USER)
            for i in range(5)
        )
    )
    statuses = sorted(r.status for r in results)
    assert statuses.count(200) >= 2 and 429 in statuses
    limited = next(r for r in results if r.status == 429)
    assert limited.headers["Retry-After"] == "1"
    for response in results:
        response.release()


async def test_metrics_can_require_a_key(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key", metrics_require_key=True)
    async with http.get(url(box, "/metrics")) as response:
        assert response.status == 401
    async with http.get(url(box, "/metrics"), headers=USER) as response:
        assert response.status == 200
    async with http.get(url(box, "/readyz")) as response:
        assert response.status == 200


async def test_keys_never_reach_the_log(start_box, http, caplog) -> None:
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key", admin_keys="admin-key")
    with caplog.at_level(logging.DEBUG):
        for headers in (USER, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Bearer admin-key"}):
            async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}, headers=headers):
                pass
    assert "user-key" not in caplog.text and "admin-key" not in caplog.text and "wrong-key" not in caplog.text


async def _raw(box, request: bytes) -> bytes:
    """One request over a bare socket (bytes no HTTP client would send), the answer's status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", box.http_port)
    writer.write(request)
    await writer.drain()
    status = await reader.readline()
    writer.close()
    return status


async def test_odd_authorization_headers_are_refused_cleanly(start_box, caplog) -> None:
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key")
    aiohttp_server, malformed = logging.getLogger("aiohttp.server"), MalformedHttpFilter()  # as `serve` sets it
    aiohttp_server.addFilter(malformed)
    try:
        await _refused_cleanly(box, caplog)
    finally:
        aiohttp_server.removeFilter(malformed)
    assert "user-key" not in caplog.text


async def _refused_cleanly(box, caplog) -> None:
    with caplog.at_level(logging.DEBUG):
        not_utf8 = await _raw(box, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer user-key\xff\r\n\r\n")
        assert b" 403 " in not_utf8  # a wrong key, not a 500
        twice = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
        twice += b"Authorization: Bearer user-key\r\n\r\n"
        assert b" 401 " in await _raw(box, twice)  # which one counts would depend on who reads them
        control = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer user-key\x7f\r\n\r\n"
        assert b" 400 " in await _raw(box, control)  # aiohttp refuses it; its raw bytes must not be logged


async def test_model_names_cannot_be_probed_without_a_key(start_box, http) -> None:
    """POST /v1/models/A/B for a name with a slash answered 405 (it exists) or 404 (it does not) to anyone."""
    box = await start_box(api_keys="user-key", admin_keys="admin-key")
    for path in ("/v1/models/sentence-transformers/all-MiniLM-L6-v2", "/v1/models/sentence-transformers/nonexistent"):
        async with http.post(url(box, path)) as response:
            assert response.status == 401, path
