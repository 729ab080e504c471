"""The wire format: round trips, and header parsing that fails only with ValueError on any input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.envelope import ReplyMeta, RequestMeta
from appliance.errors import ServiceUnavailable, Unprocessable


def test_request_meta_round_trips_through_headers() -> None:
    meta = RequestMeta(id="a1", task="embed", model="m", reply="fbx.rep.b", run="0a1b", deadline_ms=10, sent_ms=5,
                       tokens=3, adapter="lora", priority="batch", blob="k", adapter_registered_ms=1_700_000_000_123,
                       registered_ms=1_700_000_000_000)  # fmt: skip
    headers = meta.headers()
    assert headers["Nats-Msg-Id"] == "a1"
    assert RequestMeta.from_headers(headers) == meta


def test_reply_meta_round_trips_through_headers() -> None:
    meta = ReplyMeta(id="a1", status=413, box="b", queue_ms=1.5, compute_ms=2.25, rows=2, dims=3, usage_tokens=9)
    assert ReplyMeta.from_headers(meta.headers()) == meta


def test_an_error_reply_carries_its_status_and_its_retry_after_unless_told_otherwise() -> None:
    stopping = ServiceUnavailable("box b is stopping", retry_after_s=1)
    assert ReplyMeta.from_headers(ReplyMeta.for_error("a1", stopping, "b").headers()) == ReplyMeta(
        id="a1", status=503, box="b", retry_after_s=1
    )
    last = ReplyMeta.for_error("a1", Unprocessable("bad"), "b", seq=4, retry_after_s=7)
    assert (last.status, last.seq, last.final, last.retry_after_s) == (422, 4, True, 7)


def test_missing_deadline_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="Fbx-Deadline"):
        RequestMeta.from_headers({"Fbx-Id": "a", "Fbx-Task": "embed", "Fbx-Model": "m", "Fbx-Reply": "r"})


headers = st.dictionaries(
    st.sampled_from(["Fbx-Id", "Fbx-Task", "Fbx-Model", "Fbx-Reply", "Fbx-Deadline", "Fbx-Sent", "Fbx-Tokens",
                     "Fbx-Priority", "Fbx-Status", "Fbx-Queue-Ms", "Fbx-Rows", "Other"]),
    st.text(max_size=20),
)  # fmt: skip


@given(headers)
def test_request_header_parsing_raises_only_value_error(raw: dict[str, str]) -> None:
    try:
        RequestMeta.from_headers(raw)
    except ValueError:
        pass


@given(headers)
def test_reply_header_parsing_raises_only_value_error(raw: dict[str, str]) -> None:
    try:
        ReplyMeta.from_headers(raw)
    except ValueError:
        pass


def test_an_unreadable_retry_after_on_a_reply_is_no_retry_after_not_a_dropped_reply() -> None:
    """Review finding: an optional header read strictly would drop the whole reply as malformed (its client then
    waits for a 504) for what only improves the answer."""
    headers = ReplyMeta(id="r", status=503, box="b", retry_after_s=7).headers()
    assert ReplyMeta.from_headers(headers).retry_after_s == 7
    assert ReplyMeta.from_headers({**headers, "Fbx-Retry-After": "1.5"}).retry_after_s == 0
    assert ReplyMeta.from_headers({k: v for k, v in headers.items() if k != "Fbx-Retry-After"}).retry_after_s == 0
