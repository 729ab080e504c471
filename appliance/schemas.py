"""Request bodies of each API family, validated once by msgspec (C speed, clear paths in errors).

The gateway validates a body before it is queued, so a bad request is answered at once with a
4xx; the worker decodes the same bytes with the same schema to get its inputs.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Timeout = Annotated[float, msgspec.Meta(gt=0)]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI `POST /v1/embeddings`, plus TEI's `truncate` and a per-request `timeout` (s)."""

    input: str | list[str]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    truncate: bool = True
    timeout: Timeout | None = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input
