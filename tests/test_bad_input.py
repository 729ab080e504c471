"""Everything a client can get wrong is a clear 4xx in the error shape, and the box keeps serving."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import orjson
import pytest

from appliance.catalog import DEFAULT_MODEL_NAME
from appliance.gateway.http import RECEIVING
from tests.conftest import noop_model, url, wait_for

JSON = {"Content-Type": "application/json"}
EMBED = b'{"input": "x", "model": "all-minilm-l6-v2"}'
DEEP_LISTS = b'{"input": "x", "model": "all-minilm-l6-v2", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_OBJECTS = b'{"extra": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b', "input": "x", "model": "m"}'


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
        (b'{"input": [[1, 2]], "model": "all-minilm-l6-v2"}', 422, "unsupported_parameter"),  # token ids
        (b'{"input": [1, 2], "model": "all-minilm-l6-v2"}', 422, "unsupported_parameter"),
        (b'{"input": [[1, 2], "ok"], "model": "all-minilm-l6-v2"}', 422, "invalid_input"),
        (b'{"model": "all-minilm-l6-v2"}', 422, "invalid_input"),
        (b'{"input": "x", "model": 5}', 422, "invalid_input"),  # left out, it is the fleet's one (test_infinity.py)
        (b'{"input": "x", "model": "all-minilm-l6-v2", "encoding_format": "int8"}', 422, "invalid_input"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "dimensions": -1}', 422, "invalid_input"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "dimensions": 1000}', 422, "invalid_dimensions"),
        (b'{"input": "x", "model": "all-minilm-l6-v2", "timeout": -1}', 422, "invalid_input"),
        (b"[1, 2, 3]", 422, "invalid_input"),
        # Tester h181: each was answered 200, the text's vector, as if the field had not been sent.
        pytest.param(b'{"input": ["http://x/a.jpg"], "modality": "image"}', 422, "unsupported_parameter", id="image"),
        pytest.param(b'{"input": "x", "modality": "audio"}', 422, "unsupported_parameter", id="audio"),
        pytest.param(b'{"input": "x", "modality": 3}', 422, "invalid_input", id="modality-not-a-string"),
        pytest.param(b'{"input": "x", "truncate_prompt_tokens": 2}', 422, "unsupported_parameter", id="vllm-truncate"),
        pytest.param(b'{"input": "x", "add_special_tokens": false}', 422, "unsupported_parameter", id="no-special"),
        pytest.param(  # tester h184: taken silently, one of the two ignored
            b'{"input": "x", "truncate_prompt_tokens": -1, "truncate": false}', 422, "invalid_input", id="contradict"
        ),
        pytest.param(DEEP_LISTS, 400, "invalid_json", id="deep-lists-in-an-ignored-field"),
        pytest.param(DEEP_OBJECTS, 400, "invalid_json", id="deep-objects-in-an-ignored-field"),
    ],
)
async def test_bad_bodies_get_clear_client_errors(default_box, http, body, status, code) -> None:
    got, payload, _ = await post(http, default_box, body)
    assert got == status, payload
    assert_error_shape(payload, code)


@pytest.mark.parametrize(
    "fields",
    [{"modality": "text"}, {"truncate_prompt_tokens": -1}, {"add_special_tokens": True}],
    ids=["text", "model-length", "special-tokens"],
)
async def test_the_defaults_of_other_servers_embedding_fields_are_taken(default_box, http, fields) -> None:
    """Infinity's client sends `modality` "text"; vLLM's `truncate_prompt_tokens` -1 and `add_special_tokens` true
    are what fleetbox does anyway."""
    status, payload, _ = await post(http, default_box, orjson.dumps({"input": "x", **fields}))
    assert status == 200, payload
    assert len(payload["data"][0]["embedding"]) == 384


async def test_dimensions_past_a_held_models_width_are_refused_before_they_are_queued(default_box, http) -> None:
    """Tester h70: judged by the worker only, such a request was admitted or refused 429 first (a retry of what can
    never be answered, 7 of 116 times in a soak). The width a holder's heartbeat says is judged at the gateway."""
    from appliance import bus

    def said_width() -> bool:
        entries = [entry for record in default_box.fleet.live_boxes() for entry in record["models"]]
        return any(entry["name"] == DEFAULT_MODEL_NAME and entry.get("dimensions") == 384 for entry in entries)

    await wait_for(said_width, what="the default model's width in a heartbeat")
    before = await bus.next_request_sequence(default_box.js)
    body = b'{"input": "x", "model": "all-minilm-l6-v2", "dimensions": 385}'
    status, answer, _ = await post(http, default_box, body)
    assert (status, answer["error"]["code"]) == (422, "invalid_dimensions"), answer
    assert answer["error"]["message"] == "dimensions=385 is more than this model's 384"
    assert await bus.next_request_sequence(default_box.js) == before  # never queued
    status, answer, _ = await post(http, default_box, body.replace(b"385", b"384"))
    assert status == 200 and await bus.next_request_sequence(default_box.js) == before + 1, answer


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the request body is empty; send a JSON object"),
        (b" \n", "the request body is empty; send a JSON object"),
        (b'{"input": [["a"]]}', "input 0 is not a string; send a string or a list of strings"),
        (b'{"input": ["a", null]}', "input 1 is not a string; send a string or a list of strings"),
        (b'{"input": ["a", true]}', "input 1 is not a string; send a string or a list of strings"),
    ],
    ids=["empty", "whitespace", "list-of-lists", "null", "bool"],
)
async def test_what_is_wrong_with_a_body_is_said_in_its_terms(default_box, http, body: bytes, message: str) -> None:
    """Tester h103: an empty body was "malformed JSON: Input data was truncated", as if the upload were cut off, and
    `[["a"]]` was told "Expected `int`, got `str`" (the schema's token ids), where /embed names the input."""
    status, payload, _ = await post(http, default_box, body)
    assert status in (400, 422), payload
    assert payload["error"]["message"] == message


async def test_token_ids_are_refused_saying_what_to_send(default_box, http) -> None:
    """LangChain's OpenAIEmbeddings sends tiktoken's ids by default: ids of another tokenizer would embed as noise,
    and the schema error (`Expected str, got array`) did not say what to do."""
    status, payload, _ = await post(http, default_box, b'{"input": [[9906, 1917]], "model": "all-minilm-l6-v2"}')
    assert (status, payload["error"]["code"]) == (422, "unsupported_parameter"), payload
    assert "check_embedding_ctx_length=False" in payload["error"]["message"]


async def test_unknown_model_is_404_naming_the_models_that_exist(default_box, http) -> None:
    status, payload, _ = await post(http, default_box, b'{"input": "x", "model": "gpt-17"}')
    assert status == 404
    assert_error_shape(payload, "model_not_found")
    assert "gpt-17" in payload["error"]["message"] and DEFAULT_MODEL_NAME in payload["error"]["message"]
    # A name of a million characters is quoted in part, not sent back whole (black-box finding).
    long = b'{"input": "x", "model": "' + b"m" * 1_000_000 + b'", "adapter": "' + b"a" * 1_000_000 + b'"}'
    status, payload, _ = await post(http, default_box, long)
    assert status == 404 and len(payload["error"]["message"]) < 1000, len(payload["error"]["message"])
    assert "(1000000 characters)" in payload["error"]["message"]


@pytest.mark.parametrize("sent", ["text/plain", "application/json, text/plain"])
async def test_wrong_content_type_is_415_naming_what_was_sent(default_box, http, sent: str) -> None:
    """Tester h84: a Content-Type aiohttp cannot parse was said to be application/octet-stream, sent by nobody."""
    status, payload, _ = await post(http, default_box, EMBED, {"Content-Type": sent})
    assert status == 415
    assert_error_shape(payload, "unsupported_media_type")
    assert payload["error"]["message"] == f"expected Content-Type: application/json, got {sent}"


async def test_a_missing_content_type_is_415_saying_none_was_given(default_box, http) -> None:
    async with http.post(url(default_box, "/v1/embeddings"), data=EMBED, skip_auto_headers=["Content-Type"]) as got:
        assert got.status == 415
        payload = await got.json()
    assert_error_shape(payload, "unsupported_media_type")
    assert "no Content-Type" in payload["error"]["message"], payload


@pytest.mark.parametrize("charset", ["latin-1", "utf-16", "ascii"])
async def test_a_charset_other_than_utf8_is_415(default_box, http, charset) -> None:
    status, payload, _ = await post(http, default_box, EMBED, {"Content-Type": f"application/json; charset={charset}"})
    assert status == 415
    assert_error_shape(payload, "unsupported_media_type")
    assert "UTF-8" in payload["error"]["message"] and charset in payload["error"]["message"]


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", "utf8"])
async def test_a_utf8_charset_and_a_byte_order_mark_are_fine(default_box, http, charset) -> None:
    headers = {"Content-Type": f"application/json; charset={charset}"}
    status, payload, _ = await post(http, default_box, b"\xef\xbb\xbf" + EMBED, headers)
    assert status == 200, payload


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress, lambda data: zlib.compress(data, wbits=-15)])
async def test_a_gzip_or_deflate_body_is_decompressed(default_box, http, compress) -> None:
    encoding = "gzip" if compress is gzip.compress else "deflate"
    status, payload, _ = await post(http, default_box, compress(EMBED), {**JSON, "Content-Encoding": encoding})
    assert status == 200, payload
    assert len(payload["data"]) == 1


@pytest.mark.parametrize(
    ("encoding", "body", "status"),
    [
        pytest.param("gzip", EMBED, 400, id="not-gzip"),
        pytest.param("deflate", EMBED, 400, id="not-deflate"),
        pytest.param("gzip", gzip.compress(EMBED)[:-12], 400, id="gzip-cut-short"),
        pytest.param("br", EMBED, 415, id="brotli"),
        pytest.param("compress", EMBED, 415, id="compress"),
        pytest.param("gzip, br", EMBED, 415, id="two-encodings"),
    ],
)
async def test_a_bad_or_unsupported_content_encoding_is_a_clear_4xx(default_box, http, encoding, body, status) -> None:
    got, payload, _ = await post(http, default_box, body, {**JSON, "Content-Encoding": encoding})
    assert got == status, payload
    assert_error_shape(payload)
    assert "Content-Encoding" in payload["error"]["message"]


async def test_a_gzip_body_is_read_member_by_member_and_nothing_after_it(default_box, http) -> None:
    """Black-box finding: a body of two gzip members (RFC 1952; `gzip -d` reads both) was a 400, bytes after the gzip
    data were ignored (200), and of two Content-Encoding headers the first was read and the second ignored."""
    from multidict import CIMultiDict

    half = len(EMBED) // 2
    two = gzip.compress(EMBED[:half]) + gzip.compress(EMBED[half:])
    status, payload, _ = await post(http, default_box, two, {**JSON, "Content-Encoding": "gzip"})
    assert status == 200 and len(payload["data"]) == 1, payload
    for coding, body in (("gzip", gzip.compress(EMBED) + b"JUNK"), ("deflate", zlib.compress(EMBED) + b"JUNK")):
        status, payload, _ = await post(http, default_box, body, {**JSON, "Content-Encoding": coding})
        assert (status, payload["error"]["message"]) == (400, f"the body has 4 bytes after its {coding} data")
    headers = CIMultiDict([*JSON.items(), ("Content-Encoding", "identity"), ("Content-Encoding", "gzip")])
    status, payload, _ = await post(http, default_box, gzip.compress(EMBED), headers)
    assert status == 200, payload  # identity, then gzip: one coding
    headers = CIMultiDict([*JSON.items(), ("Content-Encoding", "gzip"), ("Content-Encoding", "deflate")])
    status, payload, _ = await post(http, default_box, gzip.compress(EMBED), headers)
    assert (status, payload["error"]["code"]) == (415, "unsupported_encoding"), payload


async def test_a_gzip_body_of_thousands_of_members_is_refused_before_it_costs_a_core(default_box, http) -> None:
    """Tester h84: the JSON then 400,000 empty gzip members (8 MiB, 41 bytes inflated) took 35-40 s of a core, each
    member copying the rest of the body; four at once held the threads that tokenise prompts for a minute. The
    64 members a body may have are far more than a client sends (one)."""
    empty = gzip.compress(b"")
    many = gzip.compress(EMBED) + empty * 100_000
    status, payload, _ = await post(http, default_box, many, {**JSON, "Content-Encoding": "gzip"})
    assert (status, payload["error"]["message"]) == (400, "the gzip body has more than 64 members; send it as one")
    most = gzip.compress(EMBED) + empty * 63
    status, payload, _ = await post(http, default_box, most, {**JSON, "Content-Encoding": "gzip"})
    assert status == 200, payload


async def test_a_compressed_body_that_inflates_past_max_body_bytes_is_413(default_box, http) -> None:
    bomb = gzip.compress(b" " * (default_box.settings.max_body_bytes + 1))
    status, payload, _ = await post(http, default_box, bomb, {**JSON, "Content-Encoding": "gzip"})
    assert status == 413
    assert_error_shape(payload, "payload_too_large")


async def test_a_lone_surrogate_at_the_end_of_a_string_is_named(default_box, http) -> None:
    status, payload, _ = await post(http, default_box, b'{"model": "all-minilm-l6-v2", "input": "\\ud800"}')
    assert status == 400
    assert_error_shape(payload, "invalid_json")
    assert "surrogate" in payload["error"]["message"], payload


async def test_null_for_an_optional_field_means_its_default(default_box, http) -> None:
    body = (b'{"model": "all-minilm-l6-v2", "input": "x", "encoding_format": null, "dimensions": null,'
            b' "user": null, "truncate": null, "adapter": null, "timeout": null}')  # fmt: skip
    status, payload, _ = await post(http, default_box, body)
    assert status == 200, payload
    assert len(payload["data"][0]["embedding"]) == 384


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


async def test_the_server_header_names_no_versions(default_box, http) -> None:
    """Operator tester h187: every answer said `Server: Python/3.11 aiohttp/3.14.5`, errors too."""
    for path in ("/healthz", "/v1/nothing-here"):
        async with http.get(url(default_box, path)) as response:
            assert response.headers["Server"] == "fleetbox", path
    status, _, headers = await post(http, default_box, EMBED)
    assert (status, headers["Server"]) == (200, "fleetbox")


async def test_unknown_route_and_wrong_method_use_the_error_shape(default_box, http) -> None:
    async with http.get(url(default_box, "/v1/nothing-here")) as response:
        assert response.status == 404
        assert_error_shape(await response.json(), "route_not_found")
    async with http.get(url(default_box, "/v1/embeddings")) as response:
        assert response.status == 405
        assert_error_shape(await response.json(), "method_not_allowed")
        assert response.headers["Allow"] == "POST"  # RFC 9110: a 405 names the allowed methods in `Allow`


async def test_a_trailing_slash_on_a_route_is_a_308_to_it_that_clients_follow(default_box, http) -> None:
    body = {"model": "all-minilm-l6-v2", "input": "a trailing slash"}
    async with http.post(url(default_box, "/v1/embeddings/?x=1&flag"), json=body, allow_redirects=False) as response:
        assert response.status == 308  # the same method and body, as FastAPI servers answer it
        assert response.headers["Location"] == "/v1/embeddings?x=1&flag"  # the query as sent (review h113)
        assert_error_shape(await response.json(), "route_moved")
    async with http.post(url(default_box, "/v1/embeddings/"), json=body) as response:
        assert response.status == 200  # followed, as the openai SDK and `curl -L` do
        assert len((await response.json())["data"]) == 1
    async with http.post(url(default_box, "/v1/nothing-here/"), json=body) as response:
        assert response.status == 404  # no route either way: no redirect to nowhere
        assert_error_shape(await response.json(), "route_not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/tei/all-minilm-l6-v2/embed/"), ("GET", "/v1/models/all-minilm-l6-v2/"), ("GET", "/tei/noop/info/")],
)
async def test_a_trailing_slash_after_a_model_path_is_a_308_too(default_box, http, method, path) -> None:
    """Tester h181: read as part of the model's name (a route's `{name:.+}` takes slashes), `/tei/enc/embed/` was a
    404 "model 'enc/embed/' does not exist" where every other route's trailing `/` is a 308."""
    body = {"inputs": "a trailing slash"}
    async with http.request(method, url(default_box, path), json=body, allow_redirects=False) as response:
        assert response.status == 308, await response.text()
        assert response.headers["Location"] == path.rstrip("/")
        assert_error_shape(await response.json(), "route_moved")


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/embeddings%2F"), ("GET", "/v1/models/all-minilm-l6-v2%2F"), ("POST", "/tei/all-minilm-l6-v2%2f")],
)
async def test_an_escaped_trailing_slash_is_no_redirect_to_itself(default_box, http, method, path) -> None:
    """Review h184: the 308's Location is the raw path less its `/`s, so an escaped one (`%2F`) was redirected to
    itself, for ever. Not a `/` the client wrote: a 404."""
    async with http.request(method, url(default_box, path), json={"input": "x"}, allow_redirects=False) as response:
        assert response.status == 404, await response.text()


@pytest.mark.parametrize(
    "seconds", ["soon", "1_0", "\uff11", "nan", "inf", "-Infinity", "1e400", "-1", "0", "0x10", "", "1e-9", "1e-400"]
)
async def test_bad_timeout_header_is_400(default_box, http, seconds) -> None:
    status, payload, _ = await post(http, default_box, EMBED, {**JSON, "Timeout": seconds})
    assert status == 400, payload
    assert_error_shape(payload)
    assert "Timeout header" in payload["error"]["message"]


@pytest.mark.parametrize("seconds", ["30", "2.5", "1e1", ".5", "1e9"])
async def test_a_plain_decimal_timeout_header_is_accepted(default_box, http, seconds) -> None:
    status, payload, _ = await post(http, default_box, EMBED, {**JSON, "Timeout": seconds})
    assert status == 200, payload


@pytest.mark.parametrize("seconds", [b"1e-9", b"5e-324", b"0.0009"])
async def test_a_timeout_no_request_could_meet_is_422_not_a_504(default_box, http, seconds) -> None:
    """Adversarial tester: `"timeout": 1e-9` (or a denormal) was accepted and answered 504, a 5xx for what
    the client sent. A deadline is at least a millisecond."""
    status, payload, _ = await post(
        http, default_box, b'{"input": "x", "model": "all-minilm-l6-v2", "timeout": %s}' % seconds
    )
    assert status == 422, payload
    assert "timeout" in payload["error"]["message"]


async def test_passed_deadline_is_504_with_a_clear_message(default_box, http) -> None:
    status, payload, _ = await post(http, default_box, b'{"input": "x", "model": "all-minilm-l6-v2", "timeout": 0.001}')
    assert status == 504
    assert_error_shape(payload, "deadline_exceeded")
    assert "deadline" in payload["error"]["message"]


async def test_a_504_whose_deadline_the_box_capped_does_not_advise_raising_it(start_box, http) -> None:
    """`"timeout": 10` under `max_timeout_s` 0.3: the 504 said to raise the deadline, which the client had asked
    for already (auditor h61)."""
    box = await start_box(default_model=False, models=[noop_model("slow", cost_ms=1000)], max_timeout_s=0.3)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "slow", "input": "x", "timeout": 10}) as response:
        assert response.status == 504
        message = (await response.json())["error"]["message"]
    assert message.startswith("no answer within the request's deadline of 0.3s; that is this box's longest"), message


@pytest.mark.parametrize(
    "request_head",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    ],
)
async def test_malformed_http_is_a_400_and_the_connection_is_closed(default_box, request_head) -> None:
    """As docs/api.md says: aiohttp answers these before the app sees a request, in plain text."""
    reader, writer = await asyncio.open_connection("127.0.0.1", default_box.http_port)
    try:
        writer.write(request_head)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", answer[:200]


async def test_a_body_announced_over_the_limit_is_refused_before_it_is_sent(default_box) -> None:
    """`Expect: 100-continue` (curl asks so for any body over 1 MB): the box said `100 Continue` to a 9 MB body and
    answered 413 once all of it was uploaded (adversarial tester). It answers 413 at once; within the limit, 100."""
    limit = default_box.settings.max_body_bytes
    head = "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", default_box.http_port)
    try:
        writer.write(f"{head}Content-Length: {limit + 1}\r\n\r\n".encode())
        await writer.drain()
        head_413 = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)  # no body sent: it waits
        assert head_413.split(b" ")[1] == b"413" and b"Connection: close" in head_413, head_413
        length = int(head_413.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert b"larger than the limit" in await asyncio.wait_for(reader.readexactly(length), timeout=10)
    finally:
        writer.close()
    body = b'{"model": "all-minilm-l6-v2", "input": "x"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", default_box.http_port)
    try:
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), timeout=10)).startswith(b"HTTP/1.1 100 Continue")
        await reader.readline()
        writer.write(body)
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), timeout=10)).split(b" ")[1] == b"200"
    finally:
        writer.close()


async def test_post_to_an_unknown_model_verb_is_404_not_405(default_box, http) -> None:
    async with http.post(url(default_box, "/v1/models/all-minilm-l6-v2/frobnicate")) as response:
        assert response.status == 404
        payload = await response.json()
    assert_error_shape(payload, "route_not_found")
    assert "pin" in payload["error"]["message"] and "frobnicate" in payload["error"]["message"]
    # A model name holds a `/`: its own path takes GET and DELETE, not POST, and its verbs still work.
    async with http.post(url(default_box, f"/v1/models/{DEFAULT_MODEL_NAME}")) as response:
        assert response.status == 405
        assert_error_shape(await response.json(), "method_not_allowed")
        assert response.headers["Allow"] == "DELETE,GET,HEAD,PATCH"
    async with http.post(url(default_box, f"/v1/models/{DEFAULT_MODEL_NAME}/pin")) as response:
        assert response.status == 200, await response.text()
    # And a verb's route takes POST alone: no model may be named so (it was a 404 naming model '.../pin': h99).
    for method in ("GET", "PATCH", "DELETE"):
        async with http.request(method, url(default_box, f"/v1/models/{DEFAULT_MODEL_NAME}/pin")) as response:
            assert response.status == 405, (method, await response.text())
            assert_error_shape(await response.json(), "method_not_allowed")
            assert response.headers["Allow"] == "POST"
    # A POST whose `/` before the verb is escaped names a model that does not exist: not a 405 allowing POST.
    async with http.post(url(default_box, "/v1/models/all-minilm-l6-v2%2Fpin/load")) as response:
        assert response.status == 404, await response.text()
        assert_error_shape(await response.json(), "model_not_found")


async def test_openapi_lists_the_metrics_keys_and_only_the_routes_a_worker_box_serves(
    default_box, http, start_box
) -> None:
    async with http.get(url(default_box, "/openapi.json")) as response:
        spec = await response.json()
    assert "401" in set(spec["paths"]["/metrics"]["get"]["responses"])
    assert "/v1/embeddings" in spec["paths"]
    worker = await start_box(role="worker", default_model=False, models=[noop_model()])
    async with http.get(url(worker, "/openapi.json")) as response:
        spec = await response.json()
    assert set(spec["paths"]) == {"/healthz", "/readyz", "/health", "/metrics", "/openapi.json"}
    for path in ("/v1/embeddings", "/v1/models"):
        async with http.get(url(worker, path)) as response:
            assert response.status == 404
            # It says why (h60: "no such route" on a worker's port left the operator guessing).
            assert "runs models only (--role worker)" in (await response.json())["error"]["message"]


async def test_box_still_serves_after_every_bad_request(default_box, http) -> None:
    status, payload, _ = await post(http, default_box, b'{"input": ["still here"], "model": "all-minilm-l6-v2"}')
    assert status == 200
    assert len(payload["data"][0]["embedding"]) == 384
    async with http.get(url(default_box, "/metrics")) as response:
        text = await response.text()
    assert 'fbx_http_requests_total{route="/v1/embeddings",status="500"}' not in text


async def test_a_body_that_stops_arriving_is_refused_and_its_bytes_are_let_go(start_box, http) -> None:
    """Black-box finding: an upload that stopped one byte short held its body in memory as long as its client liked
    (100 of them took 1.6 GB). A body must arrive within `body_timeout_s` (408), and the box receives at most
    `max_receiving_bytes` of bodies at once, counted as they arrive (counted at their Content-Length, headers alone
    shut uploads out: review r50): past it, 429 with a Retry-After, until a stalled one is let go."""
    box = await start_box(default_model=False, models=[noop_model()], body_timeout_s=1.0, max_body_bytes=1000,
                          max_receiving_bytes=1500)  # fmt: skip
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", box.http_port)
    try:
        writer.write(head + b'{"model": "noop", "input": "' + b"x" * 872)  # 900 bytes of 1,000, and no more
        await writer.drain()
        receiving = box.door._runner.app[RECEIVING]
        await wait_for(lambda: receiving.held == 900, what="the box to be holding the stalled body's bytes")
        body = {"model": "noop", "input": "x" * 900}
        async with http.post(url(box, "/v1/embeddings"), json=body) as crowded:
            assert crowded.status == 429 and crowded.headers["Retry-After"] == "1"
            assert "max_receiving_bytes" in (await crowded.json())["error"]["message"]
        async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}) as small:
            assert small.status == 200  # what is left of the limit still takes a small body
        timed_out = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert timed_out.split(b" ")[1] == b"408", timed_out
        length = int(timed_out.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert b'"code":"body_timeout"' in await asyncio.wait_for(reader.readexactly(length), timeout=10)
    finally:
        writer.close()
    async with http.post(url(box, "/v1/embeddings"), json=body) as freed:
        assert freed.status == 200


def test_receiving_bytes_below_one_body_is_a_settings_error() -> None:
    from appliance.settings import Settings

    with pytest.raises(ValueError, match="a body of the largest size could never be received"):
        Settings(max_body_bytes=2000, max_receiving_bytes=1000)
