"""The wire format: request and reply metadata as NATS headers around the client's own bytes.

The gateway never re-serialises a body; everything routing and the batcher need rides in
headers, parsed here and nowhere else. Parsing is total: a bad header is a `ValueError`, never a
crash further down.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from appliance.errors import FleetboxError, retry_after_of

ID = "Fbx-Id"
MSG_ID = "Nats-Msg-Id"
TASK = "Fbx-Task"
MODEL = "Fbx-Model"
ADAPTER = "Fbx-Adapter"
ADAPTER_REGISTERED = "Fbx-Adapter-Registered"  # the registration of the adapter the gateway resolved (unix ms)
REGISTERED = "Fbx-Registered"  # the registration of the model the gateway resolved (unix ms), when it has a time
DEADLINE = "Fbx-Deadline"
PRIORITY = "Fbx-Priority"
TOKENS = "Fbx-Tokens"
BLOB = "Fbx-Blob"
REPLY = "Fbx-Reply"
SENT = "Fbx-Sent"
STATUS = "Fbx-Status"
QUEUE_MS = "Fbx-Queue-Ms"
COMPUTE_MS = "Fbx-Compute-Ms"
BOX = "Fbx-Box"
ROWS = "Fbx-Rows"
DIMS = "Fbx-Dims"
USAGE_TOKENS = "Fbx-Usage-Tokens"
SEQ = "Fbx-Seq"  # a streamed reply's chunk number, from 0
FINAL = "Fbx-Final"  # "1" on a streamed reply's last chunk
RUN = "Fbx-Run"  # the run of the gateway's box that published it (`RequestMeta.run`)
COPY = "Fbx-Copy"  # a request its gateway published again: its copy's number (`RequestMeta.copy`)
RETRY_AFTER = "Fbx-Retry-After"  # an error reply's Retry-After, in seconds, for the gateway to pass on

INTERACTIVE = "interactive"
BATCH = "batch"  # bulk work: pulled only when no interactive work waits
PRIORITIES = (INTERACTIVE, BATCH)


@dataclass(slots=True, frozen=True)
class RequestMeta:
    id: str
    task: str
    model: str
    reply: str
    deadline_ms: int  # unix ms
    sent_ms: int  # unix ms, when the gateway published it
    # The run of the gateway's box (a token drawn at each start, in its heartbeat too): a box restarted under its id
    # awaits nothing of its last run, and a worker lets such a request go (`Hearing.ended`). "" from a gateway that
    # names none: judged by its heartbeat's arrival alone.
    run: str = ""
    tokens: int = 0  # the gateway's cheap estimate
    adapter: str | None = None
    priority: str = INTERACTIVE
    blob: str | None = None
    adapter_registered_ms: int = 0  # `ModelSpec.registered_ms` of the adapter as its gateway resolved it; 0 unknown
    registered_ms: int = 0  # `ModelSpec.registered_ms` of the model as its gateway resolved it; 0 unknown or none
    # A copy its gateway published again (after a lost queue or a lapse of its heartbeat), numbered from 1; 0 for the
    # first. A copy has a `Nats-Msg-Id` of its own (the stream's duplicate window knows the first's) and a blob key of
    # its own (the first's is deleted when the first is acked), and no worker takes its gateway for gone as it takes
    # its first delivery in, nor lets it go (`delivery.let_go`): it was published as its gateway's heartbeat came back.
    copy: int = 0

    @property
    def expired(self) -> bool:
        """Its deadline has passed: nobody waits for its answer any more."""
        return time.time() * 1000 >= self.deadline_ms

    def headers(self) -> dict[str, str]:
        headers = {
            ID: self.id,
            MSG_ID: f"{self.id}.copy{self.copy}" if self.copy else self.id,
            TASK: self.task,
            MODEL: self.model,
            REPLY: self.reply,
            DEADLINE: str(self.deadline_ms),
            SENT: str(self.sent_ms),
            TOKENS: str(self.tokens),
            PRIORITY: self.priority,
        }
        if self.adapter:
            headers[ADAPTER] = self.adapter
            if self.adapter_registered_ms:
                headers[ADAPTER_REGISTERED] = str(self.adapter_registered_ms)
        if self.blob:
            headers[BLOB] = self.blob
        if self.registered_ms:
            headers[REGISTERED] = str(self.registered_ms)
        if self.run:
            headers[RUN] = self.run
        if self.copy:
            headers[COPY] = str(self.copy)
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None) -> RequestMeta:
        if not headers:
            raise ValueError("request has no headers")
        try:
            request_id, task, model, reply = headers[ID], headers[TASK], headers[MODEL], headers[REPLY]
        except KeyError as exc:
            raise ValueError(f"request header {exc.args[0]} is missing") from None
        if not (request_id and task and model and reply):
            raise ValueError("request has an empty required header")
        priority = headers.get(PRIORITY) or "interactive"
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}")
        return cls(
            id=request_id,
            task=task,
            model=model,
            reply=reply,
            run=headers.get(RUN, ""),
            deadline_ms=_int(headers, DEADLINE),
            sent_ms=_int(headers, SENT, default=0),
            tokens=_int(headers, TOKENS, default=0),
            adapter=headers.get(ADAPTER) or None,
            priority=priority,
            blob=headers.get(BLOB) or None,
            adapter_registered_ms=_int(headers, ADAPTER_REGISTERED, default=0),
            registered_ms=_int(headers, REGISTERED, default=0),
            copy=_int(headers, COPY, default=0),
        )


@dataclass(slots=True, frozen=True)
class ReplyMeta:
    id: str
    status: int
    box: str
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    rows: int = 0
    dims: int = 0
    usage_tokens: int = 0
    seq: int = 0
    final: bool = True
    blob: str | None = None  # the reply body's object-store key, when it was too large to carry
    retry_after_s: int = 0  # an error's Retry-After (0: none)

    def headers(self) -> dict[str, str]:
        headers = {
            SEQ: str(self.seq),
            FINAL: "1" if self.final else "0",
            ID: self.id,
            STATUS: str(self.status),
            BOX: self.box,
            QUEUE_MS: f"{self.queue_ms:.3f}",
            COMPUTE_MS: f"{self.compute_ms:.3f}",
            ROWS: str(self.rows),
            DIMS: str(self.dims),
            USAGE_TOKENS: str(self.usage_tokens),
        }
        if self.blob:
            headers[BLOB] = self.blob
        if self.retry_after_s:
            headers[RETRY_AFTER] = str(self.retry_after_s)
        return headers

    @classmethod
    def for_error(
        cls, request_id: str, error: FleetboxError, box: str, *, seq: int = 0, retry_after_s: int | None = None
    ) -> ReplyMeta:
        """The final reply that answers a request with `error`, numbered `seq` (after the chunks already sent), with
        the error's own Retry-After unless `retry_after_s` says otherwise."""
        retry = retry_after_of(error) if retry_after_s is None else retry_after_s
        return cls(id=request_id, status=error.status, box=box, seq=seq, final=True, retry_after_s=retry)

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None) -> ReplyMeta:
        if not headers or not headers.get(ID):
            raise ValueError("reply has no Fbx-Id")
        return cls(
            id=headers[ID],
            status=_int(headers, STATUS),
            box=headers.get(BOX, ""),
            queue_ms=_float(headers, QUEUE_MS),
            compute_ms=_float(headers, COMPUTE_MS),
            rows=_int(headers, ROWS, default=0),
            dims=_int(headers, DIMS, default=0),
            usage_tokens=_int(headers, USAGE_TOKENS, default=0),
            seq=_int(headers, SEQ, default=0),
            final=headers.get(FINAL, "1") != "0",
            blob=headers.get(BLOB) or None,
            retry_after_s=retry_after_in(headers),
        )


def retry_after_in(headers: Mapping[str, str] | None) -> int:
    """An error reply's Retry-After (`Fbx-Retry-After`, seconds), read leniently: 0 when absent or unreadable."""
    return _optional_int(headers or {}, RETRY_AFTER)


def _optional_int(headers: Mapping[str, str], key: str) -> int:
    """A header a reply may carry or not, read leniently (0 when absent or unreadable): a reply is not dropped for
    what only improves its answer."""
    try:
        return max(0, int(headers.get(key) or 0))
    except ValueError:
        return 0


def _int(headers: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = headers.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"header {key} is missing")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"header {key} is not an integer: {raw!r}") from None


def _float(headers: Mapping[str, str], key: str) -> float:
    try:
        return float(headers.get(key) or 0.0)
    except ValueError:
        raise ValueError(f"header {key} is not a number") from None
