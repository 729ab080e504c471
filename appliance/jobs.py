"""What a worker does with each encoder task's request: body bytes to rows, finished rows to reply bytes.

One `TaskJobs` per task, picked by the request's `Fbx-Task` header. Replies are compact and
model-level: embeddings as little-endian float32 bytes, rerank scores as float32 per document,
labels and entities as JSON; the gateway shapes them into the client's API family.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import msgspec
import numpy as np
import orjson

from appliance.envelope import ReplyMeta
from appliance.errors import PayloadTooLarge, Unprocessable, too_many_dimensions
from appliance.schemas import ClassifyRequest, EmbeddingRequest, ExtractRequest, RerankRequest
from appliance.work import Job
from runtimes import InputTooLong, Runtime, Task, Tokenized
from runtimes.base import HeadedRuntime, PairRuntime
from runtimes.tasks.embed import finish_vectors
from runtimes.tasks.score import ScoreHead


class TaskJobs(Protocol):
    def prepare(self, body: bytes, runtime: Runtime) -> tuple[list[Tokenized], Any]: ...

    def finish(self, job: Job, reply: ReplyMeta, runtime: Runtime) -> tuple[bytes, ReplyMeta]: ...


class _EncoderJobs:
    schema: type[msgspec.Struct]

    def __init__(self) -> None:
        self._decoder = msgspec.json.Decoder(self.schema)

    def decode(self, body: bytes) -> Any:
        try:
            return self._decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise Unprocessable(f"invalid {self.schema.__name__}: {exc}") from None

    def prepare(self, body: bytes, runtime: Runtime) -> tuple[list[Tokenized], Any]:
        request = self.decode(body)
        self.check(request, runtime)
        try:
            rows = self.tokenize(request, runtime)
        except InputTooLong as exc:
            raise PayloadTooLarge(str(exc), code="input_too_long") from None
        _refuse_unknown_tokens(rows, runtime.info.vocab_size)
        return rows, request

    def check(self, request: Any, runtime: Runtime) -> None:
        """Checks that need the loaded model (its width, its labels)."""

    def tokenize(self, request: Any, runtime: Runtime) -> list[Tokenized]:
        return runtime.tokenize(request.texts(), truncate=request.truncate)

    def finish(self, job: Job, reply: ReplyMeta, runtime: Runtime) -> tuple[bytes, ReplyMeta]:
        body, rows, dims = self.result(job, runtime)
        usage = sum(row.length for row in job.rows)
        return body, replace(reply, rows=rows, dims=dims, usage_tokens=usage)

    def result(self, job: Job, runtime: Runtime) -> tuple[bytes, int, int]:
        raise NotImplementedError


def _refuse_unknown_tokens(rows: list[Tokenized], vocab_size: int | None) -> None:
    """422 for an input holding a token the model's embedding has no row for: an added special token past it (Gemma
    3's `<image_soft_token>`, registered with its own tokenizer: review h193) written as text. Looked up, it failed
    the whole batch, then was retried and dead-lettered."""
    if vocab_size is None:
        return
    for index, row in enumerate(rows):
        if row.length and int(row.ids.max()) >= vocab_size:
            bad = int(row.ids[row.ids >= vocab_size][0])
            raise Unprocessable(
                f"input {index} holds token {bad}, which the model does not have (it embeds {vocab_size}): its "
                "tokenizer has special tokens past the model's vocabulary; leave that text out"
            )


class EmbedJobs(_EncoderJobs):
    schema = EmbeddingRequest

    def check(self, request: EmbeddingRequest, runtime: Runtime) -> None:
        width = runtime.info.dimensions
        if request.dimensions is not None and width is not None and request.dimensions > width:
            raise too_many_dimensions(request.dimensions, width)
        if request.normalize is False and runtime.info.unit_only:
            raise Unprocessable(
                "normalize: false cannot be honoured: this model's network normalises its vectors itself",
                code="unsupported_parameter",
            )

    def result(self, job: Job, runtime: Runtime) -> tuple[bytes, int, int]:
        request: EmbeddingRequest = job.params
        vectors = finish_vectors(
            np.stack(job.results),  # type: ignore[arg-type]
            folder_normalizes=runtime.info.unit_vectors,
            normalize_to_unit=request.normalize,
            dimensions=request.dimensions,
        )
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        return vectors.tobytes(), vectors.shape[0], vectors.shape[1]


class ScoreJobs(_EncoderJobs):
    schema = RerankRequest

    def tokenize(self, request: RerankRequest, runtime: Runtime) -> list[Tokenized]:
        assert isinstance(runtime, PairRuntime)
        pairs = [(request.query, text) for text in request.texts()]
        return runtime.tokenize_pairs(pairs, truncate=request.truncate, most_document_tokens=request.max_tokens_per_doc)

    def result(self, job: Job, runtime: Runtime) -> tuple[bytes, int, int]:
        request: RerankRequest = job.params
        logits = np.asarray([np.asarray(r).reshape(-1)[0] for r in job.results], dtype=np.float32)
        head = runtime.head if isinstance(runtime, HeadedRuntime) else ScoreHead()  # the no-op runtime has none
        scores = np.ascontiguousarray(head.scores(logits, raw_scores=request.raw_scores), dtype="<f4")
        return scores.tobytes(), scores.shape[0], 1


class ClassifyJobs(_EncoderJobs):
    schema = ClassifyRequest

    def result(self, job: Job, runtime: Runtime) -> tuple[bytes, int, int]:
        request: ClassifyRequest = job.params
        assert isinstance(runtime, HeadedRuntime)
        head = runtime.head
        logits = np.stack([np.asarray(r, dtype=np.float32).reshape(-1) for r in job.results])
        predictions = head.predictions(
            logits, raw_scores=request.raw_scores, top_k=request.top_k, squash=request.function_to_apply
        )
        return orjson.dumps(predictions), len(predictions), 0


class ExtractJobs(_EncoderJobs):
    schema = ExtractRequest

    def result(self, job: Job, runtime: Runtime) -> tuple[bytes, int, int]:
        request: ExtractRequest = job.params
        assert isinstance(runtime, HeadedRuntime)
        head = runtime.head
        texts = request.texts()
        entities = [
            head.entities(text, np.asarray(logits), row.offsets)
            for text, logits, row in zip(texts, job.results, job.rows, strict=True)
        ]
        return orjson.dumps(entities), len(entities), 0


_JOBS: dict[str, TaskJobs] = {
    Task.EMBED.value: EmbedJobs(),
    Task.SCORE.value: ScoreJobs(),
    Task.CLASSIFY.value: ClassifyJobs(),
    Task.EXTRACT.value: ExtractJobs(),
}


def jobs_for(task: str) -> TaskJobs | None:
    return _JOBS.get(task)
