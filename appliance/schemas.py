"""Request bodies of the encoder and admin routes, validated once by msgspec (C speed, clear paths in errors).

The gateway validates a body before it is queued, so a bad request is answered at once with a
4xx; the worker decodes the same bytes with the same schema to get its inputs. As in OpenAI's API,
an explicit `null` for an optional field means "not given": such a field is typed `X | None` with
its real default, and `NullIsDefault` puts the default back after decoding. Generation's bodies are in
`appliance/generation_schemas.py`.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal

import msgspec

from appliance.settings import (
    MAX_BATCH_SIZE,
    MAX_BATCH_TOKENS,
    MAX_CONCURRENT_BATCHES,
    MAX_WAIT_MS,
    MODEL_NAME_MAX,
    MODEL_NAME_PATTERN,
)

# At least a millisecond: a deadline of 1e-9 s (or a denormal) is no deadline a request could meet, only a 504.
MIN_TIMEOUT_S = 0.001
Timeout = Annotated[float, msgspec.Meta(ge=MIN_TIMEOUT_S, description="seconds before the request's deadline")]
# JSON integers have no size limit: a count past 64 bits (`max_tokens` of 400 digits) overflowed admission's float
# arithmetic, a 500. No count a request or a model means is near it.
Positive = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
BatchTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_TOKENS)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_SIZE)]
NonEmptyText = Annotated[str, msgspec.Meta(min_length=1)]
# TEI's `dimensions`: any 64-bit count (a larger one is no width; the worker names the model's own for those over it).
TeiDimensions = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
# `/v1/embeddings`' `dimensions`: 0 too, which Infinity's client sends by default for the model's whole width.
Dimensions = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class NullIsDefault(msgspec.Struct, kw_only=True):
    """A request body in which `null` for an optional field means its default, as OpenAI's clients send it."""

    def __post_init__(self) -> None:
        for name, default in _defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


@cache
def _defaults(schema: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """The fields of a schema whose default is a value rather than None."""
    return tuple(
        (field.name, field.default)
        for field in msgspec.structs.fields(schema)
        if field.default is not msgspec.NODEFAULT and field.default is not None
    )


class EmbeddingRequest(NullIsDefault, kw_only=True):
    """OpenAI `POST /v1/embeddings`, plus TEI's `truncate` and `normalize` and a per-request `timeout` (s). OpenAI's
    token-id inputs are read only to be refused by name (the gateway's `_enqueue`): ids of another tokenizer would
    embed as noise. `normalize` left out: unit vectors when the folder normalises or `dimensions` cut them.
    `dimensions` 0 is Infinity's "no cut" (its client's default): read as left out, here, where the gateway and the
    worker (appliance/jobs.py `EmbedJobs`) both decode the client's bytes."""

    # Strings (as /openapi.json says). Read loosely so that the gateway names what else a list holds
    # (`refuse_token_ids`): typed as strings or token ids, msgspec told a list of lists of strings to send an `int`.
    input: str | Annotated[list[Any], msgspec.Meta(extra_json_schema={"items": {"type": "string"}})]
    model: str | None = None  # left out: the fleet's one model of the route's task (as TEI's and Infinity's)
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Dimensions | None = None
    user: str | None = None
    truncate: bool | None = True
    normalize: bool | None = None
    adapter: str | None = None
    timeout: Timeout | None = None
    # Other servers' fields, read to be refused unless they ask for what fleetbox does anyway (tester h181: an
    # Infinity image request was answered with its URL's text vector): `modality` (Infinity's), `truncate_prompt_tokens`
    # and `add_special_tokens` (vLLM's). The gateway judges them (`encoders.refuse_other_embeddings`).
    modality: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dimensions == 0:
            self.dimensions = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input  # type: ignore[return-value]


class Document(msgspec.Struct):
    text: str


class RerankRequest(NullIsDefault, kw_only=True):
    """Cohere/Jina `POST /v1/rerank`: documents as strings or `{text}` objects."""

    model: str | None = None  # left out: the fleet's one model of the route's task (as TEI's and Infinity's)
    query: NonEmptyText
    documents: Annotated[list[str | Document], msgspec.Meta(min_length=1)]
    top_n: Positive | None = None
    return_documents: bool | None = False
    raw_scores: bool | None = False
    truncate: bool | None = True
    max_tokens_per_doc: Positive | None = None  # Cohere v2's: each document's first tokens only
    max_chunks_per_doc: Positive | None = None  # Cohere v1's: read only to be refused above 1 (`refused`)
    rank_fields: list[str] | None = None  # Cohere's: read only to be refused for other fields than `text`
    adapter: str | None = None
    timeout: Timeout | None = None

    def texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class TeiRequest(NullIsDefault, kw_only=True):
    """What every TEI request carries (the gateway's `_enqueue_tei` reads it): `model` optional, as a TEI server
    serves one model."""

    model: str | None = None
    truncate: bool | None = True
    truncation_direction: str | None = "right"  # fleetbox cuts an over-long input at its end only
    adapter: str | None = None
    timeout: Timeout | None = None


class TeiRerankRequest(TeiRequest, kw_only=True):
    """TEI's `POST /rerank`: `texts` for the documents and a bare list back; the box queues it as the
    `RerankRequest` it stands for."""

    query: NonEmptyText
    texts: Annotated[list[str], msgspec.Meta(min_length=1)]
    raw_scores: bool | None = False
    return_text: bool | None = False


class TeiEmbedRequest(TeiRequest, kw_only=True):
    """TEI's `POST /embed`: `inputs` for the texts, `model` optional, a bare list of vectors back; the box queues it
    as the `EmbeddingRequest` it stands for. TEI's token-id inputs are read only to be refused by name, and
    `prompt_name` only to be refused: fleetbox applies no sentence-transformers prompts."""

    inputs: str | list[Any]  # strings; TEI's token ids and a batch of lists only to be refused by name (`embed_tei`)
    normalize: bool | None = True
    prompt_name: str | None = None
    dimensions: TeiDimensions | None = None


class TeiPredictRequest(TeiRequest, kw_only=True):
    """TEI's `POST /predict`: one input (a string, or a one-string list) gives one list of labels, a batch (a list of
    one-string lists) one list per input; a two-string list is TEI's sentence pair, which fleetbox's classifiers do
    not take (refused by name). Queued as the `ClassifyRequest` it stands for."""

    inputs: str | list[str | list[str]]
    raw_scores: bool | None = False
    parameters: PredictParameters | None = None  # huggingface_hub's text_classification sends them


class SimilarityInputs(msgspec.Struct, kw_only=True):
    """TEI's (and huggingface_hub's `sentence_similarity`) `inputs`: one sentence against others."""

    source_sentence: NonEmptyText
    sentences: Annotated[list[NonEmptyText], msgspec.Meta(min_length=1)]


class SimilarityParameters(NullIsDefault, kw_only=True):
    """TEI's `parameters` of a similarity request: its truncation and prompt, as at the top level."""

    truncate: bool | None = None
    truncation_direction: str | None = None
    prompt_name: str | None = None


class TeiSimilarityRequest(TeiRequest, kw_only=True):
    """TEI's `POST /similarity`: the cosine similarity of `source_sentence` to each of `sentences`, a bare list back;
    the box queues it as the `EmbeddingRequest` of all of them. `prompt_name` is read only to be refused."""

    inputs: SimilarityInputs
    prompt_name: str | None = None
    parameters: SimilarityParameters | None = None


class PredictParameters(NullIsDefault, kw_only=True):
    """huggingface_hub's `text_classification` parameters, as transformers' pipeline reads them: `top_k`, and
    `function_to_apply` ("none": the logits)."""

    top_k: Positive | None = None
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None


class TeiShape(msgspec.Struct):
    """Just enough of a body sent to TEI's `POST /` to pick the route it stands for: the model it names, a query (a
    rerank), or `inputs` that are an object (a similarity); `inputs` is kept unparsed."""

    model: Any = None
    query: Any = None
    inputs: msgspec.Raw = msgspec.Raw(b"")


class RerankShape(msgspec.Struct):
    """Just enough of a `/rerank` body to tell TEI's (`texts`) from Cohere's, Jina's and Infinity's (`documents`)."""

    texts: Any = None
    documents: Any = None


class SentDocuments(msgspec.Struct):
    """A rerank body's documents as the client wrote them, each its JSON unparsed: given back as they came."""

    documents: list[msgspec.Raw]


class ClassifyRequest(NullIsDefault, kw_only=True):
    """Infinity-style `POST /v1/classify`: per input, labels with scores, best first."""

    model: str | None = None  # left out: the fleet's one model of the route's task (as TEI's and Infinity's)
    input: str | list[str]
    raw_scores: bool | None = False
    top_k: Positive | None = None
    # transformers' text-classification `function_to_apply` (huggingface_hub sends it): left out, as the model's
    # config says (a softmax over the labels, a sigmoid per label for a multi-label or one-label model).
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    truncate: bool | None = True
    adapter: str | None = None
    timeout: Timeout | None = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class ExtractRequest(NullIsDefault, kw_only=True):
    """`POST /v1/extract`: per input, entity spans with character offsets."""

    model: str | None = None  # left out: the fleet's one model of the route's task (as TEI's and Infinity's)
    input: str | list[str]
    truncate: bool | None = True
    adapter: str | None = None
    timeout: Timeout | None = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


# A model's name or alias, as a [[models]] entry's name is judged.
# msgspec matches with `re.search`, where `$` also matches before a last newline ("abc\n" was let in): `\Z` ends it.
_NAME_PATTERN = MODEL_NAME_PATTERN.removesuffix("$") + r"\Z"
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=MODEL_NAME_MAX, pattern=_NAME_PATTERN)]
WaitMs = Annotated[float, msgspec.Meta(ge=0, le=MAX_WAIT_MS)]


class ModelRegistration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/models`: a folder under a model root becomes a model (or an adapter) of the fleet. A field it does
    not know is refused, as `PATCH` refuses it: a misspelt `pin` or `alias` was dropped without a word."""

    name: ModelName
    path: NonEmptyText
    task: Literal["embed", "score", "classify", "extract", "generate"] | None = None
    runtime: Literal["torch", "onnx"] = "torch"
    adapter_of: str | None = None
    pinned: bool = False
    aliases: list[ModelName] = msgspec.field(default_factory=list)
    dtype: Literal["float32", "float16", "bfloat16", "int8"] = "float32"
    max_batch_tokens: BatchTokens | None = None
    max_batch_size: BatchSize | None = None
    max_wait_ms: WaitMs | None = None
    concurrent_batches: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONCURRENT_BATCHES)] | None = None
    # Which tuning profile applies: "auto", "off", or a hardware slug such as "cpu-16c" (docs/tuning.md).
    profile: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$")] = "auto"
    # Runtime knobs, e.g. {"max_batch_size": 16} for a generator, {"onnx_file": "..."} for a shipped ONNX.
    options: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)


class ModelUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`PATCH /v1/models/{name}`: what may change in a registered model without loading it again. A field left
    out (or null) is kept; `aliases` is the whole new list. Judged by appliance/model_update.py."""

    aliases: list[ModelName] | None = None
    pinned: bool | None = None
    max_batch_tokens: BatchTokens | None = None
    max_batch_size: BatchSize | None = None
    max_wait_ms: WaitMs | None = None


class BoxTarget(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/models/{name}/load|evict`: which box (default: a load's this one or the freest worker,
    an eviction's every box holding it). A field it does not know is refused: a typo of `box`, ignored, evicted the
    model from every box (tester h146)."""

    box: str | None = None
