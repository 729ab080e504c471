"""Fast (Rust) tokenisation for a model folder, with TEI-style truncation.

The one trick: over-long inputs are detected without tokenising a huge text twice. A second
tokenizer truncates one token past the model's maximum, so a row of `max_length + 1` tokens means
"too long" when the caller refused truncation.

Memory is bounded whatever a client sends. The Rust tokenizer keeps every truncated-away window
("overflowing" encodings): about 100 bytes a token of the whole text, and for a pair the windows
of both sides combined, quadratic (measured: two 2,000-word sides made 178,528 tokens). So a text
is cut to `_CHARS_PER_TOKEN` characters a token of the model's maximum before it is tokenised (far
more than the kept tokens span, but for text of runs the tokenizer drops or of words that become one
[UNK]), and each over-long side of a pair is first cut, alone, just past `max_length` tokens: the
pair then truncates exactly as before (see `_cut_pairs`; for two sides past the character cap,
which one gets the odd token of the half-and-half share may differ).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Encoding, Tokenizer

from runtimes.base import InputTooLong, Tokenized

_FALLBACK_MAX_LENGTH = 512
_CHARS_PER_TOKEN = 64  # a text is cut to this many characters a token of the model's maximum


# RoBERTa and its kin number positions from `pad_token_id + 1` (514 positions hold 512 tokens):
# counted from 0, the last inputs would index past the position table.
_POSITIONS_AFTER_PADDING = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "ibert", "longformer", "mpnet",
     "roberta-prelayernorm", "luke"}
)  # fmt: skip
# Families whose code numbers positions from a padding index of its own, whatever config.json's pad_token_id says.
_FIXED_PADDING_INDEX = {"mpnet": 1}


def model_max_length(folder: Path) -> int:
    """The longest input the model accepts, as sentence-transformers would truncate it, within its position table: a
    `max_seq_length` of 512 over 128 positions was taken as said, and the load's warm-up at 512 tokens failed, every
    request a 503 after a 201 (tester h88; sentence-transformers itself fails on inputs past 128 tokens there)."""
    positions = _positions(folder)
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        value = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return min(value, positions or value)
    limits = [positions] if positions else []
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file():
        value = json.loads(tok_config.read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value < 1_000_000:
            limits.append(value)
    return min(limits) if limits else _FALLBACK_MAX_LENGTH


def _positions(folder: Path) -> int | None:
    """The tokens the model's position table holds, as its config.json says; None where it does not say."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    values = json.loads(config.read_text())
    model_type = values.get("model_type")
    value = values.get(_positions_field(model_type), values.get("max_position_embeddings"))
    if not isinstance(value, int) or value <= 0:
        return None
    if model_type in _POSITIONS_AFTER_PADDING:
        pad = _FIXED_PADDING_INDEX.get(model_type, values.get("pad_token_id"))
        value -= (pad if isinstance(pad, int) and pad >= 0 else 1) + 1
    return max(1, value)


def _positions_field(model_type: object) -> str:
    """The config.json field that holds how many positions a family's model has: `max_position_embeddings`, or the
    field transformers reads it from (GPT-2's `n_positions`: read as absent, a 256-position generator took prompts
    of 512 tokens and failed to load with an IndexError)."""
    if isinstance(model_type, str):
        from transformers import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type].attribute_map.get("max_position_embeddings", "max_position_embeddings")
    return "max_position_embeddings"


class TextTokenizer:
    """Turns texts (or text pairs) into `Tokenized` rows; thread-safe once built."""

    def __init__(self, folder: Path, max_length: int | None = None, *, keep: Literal["start", "end"] = "start") -> None:
        """`keep="end"` truncates from the left, for prompts: a causal LM continues the end of its input."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (a fast tokenizer is required)")
        self.max_length = max_length or model_max_length(folder)
        direction = "left" if keep == "end" else "right"
        self._truncating = Tokenizer.from_file(str(path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(self.max_length, direction=direction)
        self._probing = Tokenizer.from_file(str(path))
        self._probing.no_padding()
        self._probing.enable_truncation(self.max_length + 1, direction=direction)
        self._keep_end = keep == "end"
        self._char_cap = self.max_length * _CHARS_PER_TOKEN
        self.pad_id = self._truncating.token_to_id("[PAD]") or 0

    @property
    def regular_vocab(self) -> dict[str, int]:
        """Token to id, added (special) tokens left out: the ids a model's embedding must hold."""
        return self._truncating.get_vocab(with_added_tokens=False)

    def tokenize(
        self,
        texts: Sequence[str],
        *,
        truncate: bool = True,
        with_offsets: bool = False,
        add_special_tokens: bool = True,
    ) -> list[Tokenized]:
        """`with_offsets` keeps each token's character span, for tasks that point back into the text."""
        encodings = self.encode(texts, truncate=truncate, add_special_tokens=add_special_tokens)
        return [_to_row(enc, with_offsets) for enc in encodings]

    def tokenize_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool = True) -> list[Tokenized]:
        """(query, document) pairs as one row each, `[CLS] q [SEP] d [SEP]` with type ids 0 then 1.

        Truncation is longest-first, as a cross-encoder was trained and as sentence-transformers cuts:
        with a short query and a long document only the document loses tokens.
        """
        return [_to_row(enc, False) for enc in self.encode(pairs, truncate=truncate)]

    def first_tokens(self, texts: Sequence[str], most: int) -> list[str]:
        """Each text cut after its first `most` tokens (special tokens not counted), at a token's end: Cohere's
        `max_tokens_per_doc`. A cut at or past `max_length` is the truncation's own, so none is made here."""
        if most >= self.max_length:
            return list(texts)
        capped = [self._capped_text(text) for text in texts]
        encodings = self._probing.encode_batch(capped, add_special_tokens=False)
        return [
            text if len(enc.ids) <= most else text[: enc.offsets[most - 1][1]]
            for text, enc in zip(capped, encodings, strict=True)
        ]

    def encode(
        self,
        texts: Sequence[str] | Sequence[tuple[str, str]],
        *,
        truncate: bool = True,
        add_special_tokens: bool = True,
    ) -> list[Encoding]:
        """Raw encodings (with offsets), for tasks that map tokens back to characters."""
        inputs = [self._capped(text) for text in texts]
        if inputs and isinstance(inputs[0], tuple):
            inputs = self._cut_pairs(inputs)  # type: ignore[arg-type]
        if truncate:
            return self._truncating.encode_batch(inputs, add_special_tokens=add_special_tokens)
        encodings = self._probing.encode_batch(inputs, add_special_tokens=add_special_tokens)
        for index, enc in enumerate(encodings):
            if len(enc.ids) > self.max_length:
                what = f"the query with document {index}" if isinstance(inputs[index], tuple) else None
                raise InputTooLong(index, self.max_length, what=what)
        return encodings

    @property
    def char_cap(self) -> int:
        """The characters of a text past which it is cut before it is tokenised (see the module's docstring)."""
        return self._char_cap

    def _capped(self, text: str | tuple[str, str]) -> str | tuple[str, str]:
        if isinstance(text, tuple):
            return (self._capped_text(text[0]), self._capped_text(text[1]))
        return self._capped_text(text)

    def _capped_text(self, text: str) -> str:
        if len(text) <= self._char_cap:
            return text
        return text[-self._char_cap :] if self._keep_end else text[: self._char_cap]

    def _cut_pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Each over-long side cut, alone, just past `max_length` tokens: the pair's windows stay few.

        Longest-first truncation shares the room by which side is longer, and by the shorter's length
        when it fits: so an over-long side keeps `max_length + 1` tokens, one more when both are over
        and it was the longer, and the pair comes out as it would whole.
        """
        sides = [side for pair in pairs for side in pair]
        encodings = self._probing.encode_batch(sides, add_special_tokens=False)
        totals = [_token_count(enc) for enc in encodings]
        limit = self.max_length
        cut: list[str] = []
        for i in range(0, len(sides), 2):
            keep = [limit + 1 if totals[j] > limit else totals[j] for j in (i, i + 1)]
            if min(totals[i], totals[i + 1]) > limit and totals[i] != totals[i + 1]:
                keep[0 if totals[i] > totals[i + 1] else 1] += 1
            for j, tokens in zip((i, i + 1), keep, strict=True):
                cut.append(_prefix(sides[j], encodings[j], tokens) if tokens < totals[j] else sides[j])
        return list(zip(cut[0::2], cut[1::2], strict=True))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._truncating.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._truncating.token_to_id(token)


def _prefix(text: str, enc: Encoding, tokens: int) -> str:
    """`text` up to the end of its `tokens`-th token (`enc` keeps the first window and the overflowing ones)."""
    kept = len(enc.ids)
    end = enc.offsets[tokens - 1][1] if tokens <= kept else enc.overflowing[0].offsets[tokens - kept - 1][1]
    return text[:end]


def _token_count(enc: Encoding) -> int:
    """All the tokens of a truncated text: its kept window and the overflowing ones (no stride)."""
    return len(enc.ids) + sum(len(window.ids) for window in enc.overflowing)


def _to_row(enc: Encoding, with_offsets: bool) -> Tokenized:
    offsets = None
    if with_offsets:
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        # Special tokens point at no text; mark them so nothing downstream mistakes (0, 0) for a span.
        offsets[np.asarray(enc.special_tokens_mask, dtype=bool)] = -1
    return Tokenized(
        ids=np.asarray(enc.ids, dtype=np.int64),
        type_ids=np.asarray(enc.type_ids, dtype=np.int64),
        offsets=offsets,
    )
