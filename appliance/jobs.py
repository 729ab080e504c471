"""What a worker does with each task's request: body bytes to rows, finished rows to reply bytes.

One `TaskJobs` per task; the worker picks it by the request's `Fbx-Task` header. Replies are
compact: embeddings travel as little-endian float32 bytes and are formatted for the client's API
family at the gateway.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np

from appliance.batcher import Job
from appliance.envelope import ReplyMeta
from appliance.errors import PayloadTooLarge, Unprocessable
from appliance.schemas import EmbeddingRequest
from runtimes import InputTooLong, Runtime, Task, Tokenized
from runtimes.tasks.embed import truncate_dimensions


class TaskJobs(Protocol):
    def prepare(self, body: bytes, runtime: Runtime) -> tuple[list[Tokenized], object]: ...

    def finish(self, job: Job, reply: ReplyMeta) -> tuple[bytes, ReplyMeta]: ...


class EmbedJobs:
    _decoder = msgspec.json.Decoder(EmbeddingRequest)

    def prepare(self, body: bytes, runtime: Runtime) -> tuple[list[Tokenized], EmbeddingRequest]:
        try:
            request = self._decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise Unprocessable(f"invalid embeddings request: {exc}") from None
        width = runtime.info.dimensions
        if request.dimensions is not None and width is not None and request.dimensions > width:
            raise Unprocessable(
                f"dimensions={request.dimensions} is more than this model's {width}", code="invalid_dimensions"
            )
        try:
            rows = runtime.tokenize(request.texts(), truncate=request.truncate)
        except InputTooLong as exc:
            raise PayloadTooLarge(str(exc), code="input_too_long") from None
        return rows, request

    def finish(self, job: Job, reply: ReplyMeta) -> tuple[bytes, ReplyMeta]:
        request: EmbeddingRequest = job.params
        vectors = truncate_dimensions(np.stack(job.results), request.dimensions)  # type: ignore[arg-type]
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        usage = sum(row.length for row in job.rows)
        meta = ReplyMeta(
            id=reply.id,
            status=200,
            box=reply.box,
            queue_ms=reply.queue_ms,
            compute_ms=reply.compute_ms,
            rows=vectors.shape[0],
            dims=vectors.shape[1],
            usage_tokens=usage,
        )
        return vectors.tobytes(), meta


def jobs_for(task: str) -> TaskJobs | None:
    return {Task.EMBED.value: EmbedJobs()}.get(task)
