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
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="fleetbox"'  # HTTP requires it of a 401 (h103)
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


async def test_a_wrong_key_is_what_the_openai_sdk_reads_as_an_authentication_error(start_box) -> None:
    """A key that is none of the box's is 401, as OpenAI, vLLM and TEI answer it (it was 403: the SDK raised
    `PermissionDeniedError`, and code catching `AuthenticationError` missed it)."""
    from openai import AsyncOpenAI, AuthenticationError

    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key", admin_keys="admin-key")
    base_url = url(box, "/v1")
    async with AsyncOpenAI(base_url=base_url, api_key="wrong-key", max_retries=0) as client:
        try:
            await client.embeddings.create(model="noop", input="x")
        except AuthenticationError as refused:
            assert refused.status_code == 401 and refused.code == "unauthorized"
        else:
            raise AssertionError("a wrong key was let in")
    for key in ("user-key", "admin-key"):  # an admin key may call inference routes too
        async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
            assert len((await client.embeddings.create(model="noop", input="x")).data) == 1


async def test_a_refusal_before_a_withheld_body_closes_its_connection(start_box) -> None:
    """Review finding: a body over the limit announced with `Expect: 100-continue` is not asked for; answered 401
    (no key, checked before the body), the connection stayed open and the client's next request on it was read as
    that body (no answer in 3 s). The answer closes it."""
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key")
    reader, writer = await asyncio.open_connection("127.0.0.1", box.http_port)
    try:
        over = box.settings.max_body_bytes + 1
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {over}\r\n"
        writer.write(f"{head}\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.split(b" ")[1] == b"401" and b"Connection: close" in head, head
    finally:
        writer.close()


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
        assert b" 401 " in not_utf8  # a key that is none of the box's, not a 500
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


async def test_browser_apps_on_allowed_origins_may_call_the_api(start_box, http, generator_dir) -> None:
    """No CORS at all: a browser's preflight got a 405 and its answers no Access-Control-Allow-Origin, so a web
    app could not call a box (vLLM, TEI and Infinity all allow it). Allowed origins only; keys still apply."""
    from appliance.settings import ModelEntry

    gen = ModelEntry(name="gen", path=generator_dir, task="generate", pinned=True)
    box = await start_box(default_model=False, models=[noop_model(), gen], api_keys="user-key",
                          cors_allow_origins="https://app.example.com")  # fmt: skip
    app = {"Origin": "https://app.example.com"}
    asking = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    async with http.options(url(box, "/v1/embeddings"), headers=app | asking) as response:  # no key: a preflight
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
        assert response.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
        assert response.headers["Fbx-Request-Id"] == response.headers["X-Request-Id"]  # every answer has one (h99)
    body = {"model": "noop", "input": "x"}
    async with http.post(url(box, "/v1/embeddings"), json=body, headers=app | USER) as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]
        assert response.headers["Vary"] == "Origin"
    async with http.post(url(box, "/v1/embeddings"), json=body, headers=app) as response:
        assert response.status == 401  # the key is still needed
        assert response.headers["Access-Control-Allow-Origin"] == "https://app.example.com"  # and readable
    stream = {"model": "gen", "prompt": "Hi", "max_tokens": 2, "stream": True}
    async with http.post(url(box, "/v1/completions"), json=stream, headers=app | USER) as response:
        assert response.status == 200  # headers sent before the handler returned: still there
        assert response.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        await response.read()
    elsewhere = {"Origin": "https://evil.example.net"}
    async with http.options(url(box, "/v1/embeddings"), headers=elsewhere | asking) as response:
        assert response.status == 405 and "Access-Control-Allow-Origin" not in response.headers
    async with http.post(url(box, "/v1/embeddings"), json=body, headers=elsewhere | USER) as response:
        assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers
        assert response.headers["Vary"] == "Origin"  # a cache must not hand this answer to an allowed origin
    box.draining = True  # a stopping box: the page can read its 503 only if the preflight passed
    try:
        async with http.options(url(box, "/v1/embeddings"), headers=app | asking) as response:
            assert response.status == 204
        async with http.post(url(box, "/v1/embeddings"), json=body, headers=app | USER) as response:
            assert response.status == 503
            assert response.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    finally:
        box.draining = False


async def test_a_preflight_is_allowed_only_for_a_route_and_method_the_box_has(start_box, http) -> None:
    """A preflight was answered 204, allowing every method, for any path and any method asked (tester finding): a
    browser was told a route exists that does not. Now a path without the method asked gets the answer a request
    without CORS would (404, or 405), with no Access-Control-Allow-* header; one with it is allowed its own methods."""
    box = await start_box(default_model=False, models=[noop_model()], cors_allow_origins="https://app.example.com")
    app = {"Origin": "https://app.example.com"}

    async def preflight(path: str, method: str) -> tuple[int, dict[str, str]]:
        asking = app | {"Access-Control-Request-Method": method, "Access-Control-Request-Headers": "authorization"}
        async with http.options(url(box, path), headers=asking) as response:
            allow = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-allow")}
            return response.status, allow

    for path, method, status in (
        ("/v1/no-such-route", "POST", 404),
        ("/v1/embeddings", "DELETE", 405),
        ("/v1/embeddings", "PUT", 405),
        ("/healthz", "POST", 405),
        ("/v1/embeddings", "OPTIONS", 405),  # a plain OPTIONS is a 405 too: it was allowed (review h201)
    ):
        assert await preflight(path, method) == (status, {}), (path, method)
    status, allow = await preflight("/v1/embeddings", "POST")
    assert status == 204 and allow["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert "POST" in allow["Access-Control-Allow-Methods"].split(", ")
    assert "DELETE" not in allow["Access-Control-Allow-Methods"].split(", ")
    status, allow = await preflight("/v1/models/noop", "DELETE")  # an admin route: the key is checked on the call
    assert status == 204 and "DELETE" in allow["Access-Control-Allow-Methods"].split(", ")
    status, allow = await preflight("/healthz", "GET")
    assert status == 204 and "POST" not in allow["Access-Control-Allow-Methods"].split(", ")


async def test_no_cors_headers_unless_origins_are_allowed(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model()])
    headers = {"Origin": "https://app.example.com"}
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}, headers=headers) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def _head(box, request: bytes) -> bytes:
    """The head of the answer to `request` sent over a bare socket, and its body (by its Content-Length)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", box.http_port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) if b"Content-Length: " in head else 0
        return head + await asyncio.wait_for(reader.readexactly(length), timeout=10)
    finally:
        writer.close()


async def test_a_body_is_asked_for_only_with_a_key_and_odd_expectations_are_errors(start_box, http) -> None:
    """Black-box finding: `100 Continue` went out before the key was checked, inviting a client without one to upload
    8 MiB for its 401; an `Expect` other than 100-continue was a text/plain 417 no log or metric saw. A key after
    `Bearer` and more than one space was refused (RFC 9110 allows them); `/metrics` named an "API key" where only
    admin keys open it."""
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key")
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 30\r\n"
    refused = await _head(box, head + b"Expect: 100-continue\r\n\r\n")
    assert refused.split(b" ")[1] == b"401" and b"Connection: close" in refused, refused
    reader, writer = await asyncio.open_connection("127.0.0.1", box.http_port)
    try:
        writer.write(head + b"Expect: 100-continue\r\nAuthorization: Bearer user-key\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), timeout=10)).startswith(b"HTTP/1.1 100 Continue")
    finally:
        writer.close()
    odd = await _head(box, head + b"Authorization: Bearer user-key\r\nExpect: 200-ok\r\n\r\n")
    assert odd.split(b" ")[1] == b"417" and b"Fbx-Request-Id" in odd, odd
    assert b'"code":"expectation_failed"' in odd and b"200-ok" in odd, odd
    spaced = {"Authorization": "Bearer   user-key"}
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}, headers=spaced) as answer:
        assert answer.status == 200, await answer.text()
    admin_only = await start_box(default_model=False, models=[noop_model()], admin_keys="admin-key",
                                 metrics_require_key=True)  # fmt: skip
    async with http.get(url(admin_only, "/metrics")) as answer:
        assert answer.status == 401 and "API or admin key" in (await answer.json())["error"]["message"]
    reader, writer = await asyncio.open_connection("127.0.0.1", admin_only.http_port)
    try:  # its inference routes are open: a keyless client is asked for its body (review r50)
        writer.write(head + b"Expect: 100-continue\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), timeout=10)).startswith(b"HTTP/1.1 100 Continue")
    finally:
        writer.close()


async def test_an_idle_kept_alive_connection_is_closed(start_box, monkeypatch) -> None:
    """Tester h84: an idle kept-alive connection was still open after 400 s (aiohttp's 3,630 s), and 19,990 of them
    reached the box's open-files limit. The box closes one after `KEEPALIVE_S` (75 s; half a second here)."""
    from appliance.gateway import door

    monkeypatch.setattr(door, "KEEPALIVE_S", 0.5)
    box = await start_box(default_model=False, models=[noop_model()])
    reader, writer = await asyncio.open_connection("127.0.0.1", box.http_port)
    try:
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{box.http_port}\r\n\r\n".encode())
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200"), "the request answered, the connection kept"
        async with asyncio.timeout(10):
            while await reader.read(65536):  # the rest of the answer, then the server's close
                pass
    finally:
        writer.close()


async def test_with_api_keys_alone_the_admin_routes_need_one(start_box, http) -> None:
    """Tester h191: with `api_keys` set and no `admin_keys`, a client with no key (or a wrong one) unpinned, evicted
    and deleted the default model (200 each), and could register a model. Then any API key administers."""
    from appliance import serve_checks

    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key")
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        async with http.post(url(box, "/v1/models/noop/evict"), headers=headers) as answer:
            assert answer.status == 401, await answer.text()
        async with http.delete(url(box, "/v1/models/noop"), headers=headers) as answer:
            assert answer.status == 401, await answer.text()
    async with http.post(url(box, "/v1/models/noop/unpin"), headers=USER) as answer:
        assert answer.status == 200, await answer.text()
    (warning,) = serve_checks.open_routes_warnings(box.settings)
    assert "every API key may also register" in warning


def test_serve_warns_of_routes_its_keys_leave_open() -> None:
    """The Docker image listens on every address with no key: said at start, with what it leaves open."""
    from appliance.serve_checks import open_routes_warnings
    from appliance.settings import Settings

    (everyone,) = open_routes_warnings(Settings(host="0.0.0.0"))
    assert "every route, admin included, is open" in everyone
    assert open_routes_warnings(Settings(host="127.0.0.1")) == []
    assert open_routes_warnings(Settings(host="::1")) == []
    assert open_routes_warnings(Settings(host="[::1]")) == []
    assert open_routes_warnings(Settings(host="0.0.0.0", api_keys="k", admin_keys="a")) == []
    assert open_routes_warnings(Settings(host="0.0.0.0", role="worker")) == []
