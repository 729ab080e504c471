"""Which task a model folder serves, read from its files before anything is loaded.

The rule, in order: a `*ForSequenceClassification` head scores (one label: a reranker) or classifies
(more); a `*ForTokenClassification` head extracts; a sentence-transformers folder (`modules.json`)
embeds, even when its backbone is a causal LM (Qwen3-Embedding, say); a `*ForCausalLM` generates;
a bare text encoder (`BertModel`, `XLMRobertaModel`, ...) embeds with mean pooling. The model type
must be one transformers implements itself, since fleetbox never runs a folder's own code, and a
fast tokenizer (`tokenizer.json`) is required for all of them. Anything else is `UnsupportedModel`,
with a message that lists what is supported.

`check_loadable` then refuses what a load would certainly refuse, where that is cheap to see (no
weights file, a config.json with more layers than the weights hold, a tokenizer that does not load,
generation on ONNX, a generator with a layer that is not full attention: runtimes/attention.py, or a
chat template that does not compile: runtimes/chat_template.py), then what transformers' own
config class refuses (runtimes/config_check.py, the load's own call: 1 ms on a box that runs models,
0.8 s in a child process on a gateway), and last, for all but a generator, a tokenizer with ids past
the model's `vocab_size`, so a registration fails at once rather than every request after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtimes.attention import layer_types_in, refuse_other_layers
from runtimes.base import (
    SAFETENSORS_INDEX,
    RuntimeKind,
    Task,
    UnsupportedModel,
    safetensors_files,
    shipped_onnx,
)
from runtimes.chat_template import check_chat_template
from runtimes.config_check import judge_config
from runtimes.implemented import implemented, model_types
from runtimes.tasks.classify import labels_from_config
from runtimes.tasks.score import ScoreHead, check_one_logit

__all__ = [
    "SUPPORTED",
    "UnsupportedModel",
    "check_loadable",
    "detect_task",
]

SUPPORTED = (
    "*ForSequenceClassification with one label (score) or more (classify), "
    "*ForTokenClassification (extract), *ForCausalLM or *LMHeadModel (generate), "
    "and sentence-transformers folders or bare text encoders such as BertModel (embed)"
)
# What transformers' `from_pretrained` reads (sharded or whole), and peft's for an adapter.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Generous bounds on the sizes config.json gives (the largest open models: ~130 layers, width 16k,
# vocabularies of 260k): past them the file is wrong, and building what it says would exhaust the box.
_MOST = {
    "num_hidden_layers": 1024,
    "hidden_size": 65_536,
    "intermediate_size": 262_144,
    "num_attention_heads": 1024,
    "vocab_size": 4_194_304,
}
_MOST_LABELS = 262_144  # a classifier's labels: transformers makes a name for each while it reads the config


def detect_task(folder: Path) -> Task:
    """The task this folder serves; `UnsupportedModel` says why not when there is none."""
    folder = Path(folder)
    if not folder.is_dir():  # "has no config.json" hid that the folder itself is missing
        raise UnsupportedModel(f"{folder} {'is not a folder' if folder.exists() else 'does not exist'}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UnsupportedModel(f"{folder} has no config.json; a transformers model folder is expected")
    config = json_object(config_file)
    if not (folder / "tokenizer.json").is_file():
        raise UnsupportedModel(f"{folder} has no tokenizer.json; fleetbox needs a fast (Rust) tokenizer")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise UnsupportedModel(
            f'{config_file}: architectures must be a list of class names (e.g. ["BertModel"]), '
            f"not {json.dumps(architectures)}"
        )
    architectures = tuple(architectures)
    model_type = config.get("model_type") or ""
    if not isinstance(model_type, str):
        raise UnsupportedModel(f"{config_file}: model_type must be a string, not {json.dumps(model_type)}")
    if not model_type:  # transformers cannot build a model without it; "BertModel is not supported" hid why (h80)
        raise UnsupportedModel(f'{config_file} has no model_type (e.g. "bert"); transformers needs it')
    _check_sizes(config, config_file)
    task = _task_from(architectures, model_type, config, sentence_transformers=(folder / "modules.json").is_file())
    if task is None:
        named = ", ".join(architectures) or f"model type {model_type or 'unknown'}"
        raise UnsupportedModel(f"{folder}: {named} is not supported; fleetbox serves {SUPPORTED}")
    if not implemented(model_type, task):
        raise UnsupportedModel(
            f"{folder}: model type {model_type!r} is not implemented in transformers (fleetbox never runs a "
            f"model folder's own code); fleetbox serves {SUPPORTED}"
        )
    return task


def _task_from(
    architectures: tuple[str, ...], model_type: str, config: dict, *, sentence_transformers: bool
) -> Task | None:
    def has(*suffixes: str) -> bool:
        return any(name.endswith(suffixes) for name in architectures)

    if has("ForSequenceClassification"):
        return Task.SCORE if len(labels_from_config(config)) == 1 else Task.CLASSIFY
    if has("ForTokenClassification"):
        return Task.EXTRACT
    if sentence_transformers:
        return Task.EMBED
    if has("ForCausalLM", "LMHeadModel"):
        return Task.GENERATE
    if has("Model", "ForMaskedLM") or not architectures:
        return Task.EMBED if _is_text_encoder(model_type) else None
    return None


def _is_text_encoder(model_type: str) -> bool:
    return model_type in model_types("MODEL_FOR_MASKED_LM_MAPPING_NAMES")


def check_safetensors_whole(files: list[Path], *, required: bool) -> None:
    """Refuse safetensors files a load could not read: a file the weights need that is missing (a shard the index
    names; with `required`, any), a header that is not one, or a file whose size is not the one its header
    describes (a copy cut short, a Git LFS pointer in place of the weights). Such a folder registered, then failed
    every load with a 503 (planning item). Reads the headers only, as safetensors checks them before a tensor."""
    for file in files:
        if not file.is_file():
            if required:
                raise UnsupportedModel(f"{file.name} is missing from {file.parent}; its weights index names it")
            continue
        described = _described_size(file)
        if described is None:
            raise UnsupportedModel(f"{file} is not a safetensors file: its header cannot be read")
        held = file.stat().st_size
        if held != described:
            raise UnsupportedModel(
                f"{file} holds {held:,} bytes where its header describes {described:,}: the file is "
                f"{'cut short' if held < described else 'longer than its tensors'}; copy the weights again"
            )


def _described_size(file: Path) -> int | None:
    """The size a safetensors file's header describes (8 bytes of length, the JSON header, then the tensors' data
    to the last tensor's end), or None when the header is not one."""
    try:
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= 100 * 2**20:
                return None
            header = json.loads(handle.read(size))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    end = 0
    for key, value in header.items():
        if key == "__metadata__":
            continue
        offsets = value.get("data_offsets") if isinstance(value, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)):
            return None
        end = max(end, offsets[1])
    return 8 + size + end


def safetensors_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Every tensor's shape from the files' safetensors headers (an 8-byte length, then JSON); {} when any file
    is missing or not safetensors."""
    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            with file.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                if not 0 < size <= 100 * 2**20:
                    return {}
                header = json.loads(handle.read(size))
        except (OSError, ValueError):
            return {}
        if not isinstance(header, dict):
            return {}
        for key, value in header.items():
            shape = value.get("shape") if isinstance(value, dict) else None
            if isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
                shapes[key] = shape
    return shapes


def _check_sizes(config: Mapping[str, Any], config_file: Path) -> None:
    """Refuse sizes no model has: transformers would build the model they describe before reading a weight
    (a billion layers of a tiny model is a box's memory gone, and a load that never ends)."""
    for where in (config, config.get("text_config")):
        if not isinstance(where, Mapping):
            continue
        for key, most in _MOST.items():
            value = where.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
                raise UnsupportedModel(
                    f"{config_file}: {key} is {json.dumps(value)[:40]}; a whole number from 1 to {most} is expected"
                )
    labels = config.get("num_labels")
    if (isinstance(labels, int) and labels > _MOST_LABELS) or len(config.get("id2label") or ()) > _MOST_LABELS:
        raise UnsupportedModel(
            f"{config_file}: more than {_MOST_LABELS} labels; no classifier fleetbox serves has so many"
        )


def check_loadable(folder: Path, task: Task, runtime: RuntimeKind, options: Mapping[str, Any]) -> None:
    """Raise `UnsupportedModel` for a folder (detected as `task`) that `runtimes.load_runtime` would refuse.

    Reads the tokenizer whole and may wait on a child process for up to `JUDGE_TIMEOUT_S`, so call it off the
    event loop.
    """
    folder = Path(folder)
    if task is Task.GENERATE and runtime is not RuntimeKind.TORCH:
        raise UnsupportedModel(f"generation runs on the torch runtime, not {runtime}")
    if task in (Task.CLASSIFY, Task.EXTRACT):  # its labels, as the head will read them (h141: a gap, then 503s)
        labels_from_config(json_object(folder / "config.json"))
    if task is Task.SCORE:
        config = json_object(folder / "config.json")
        check_one_logit(folder, labels_from_config(config))
        ScoreHead.from_config(config, folder)  # an activation fleetbox does not apply is refused
    if task is Task.EMBED:  # its sentence-transformers modules, as the load will run them
        from runtimes.tasks.embed import EmbedHead

        try:
            EmbedHead.from_folder(folder, weights=False)
        except (ValueError, OSError) as exc:  # a modules.json or module config that is not JSON, say
            raise UnsupportedModel(f"{folder}: its sentence-transformers modules cannot be read: {exc}") from None
    if task is Task.GENERATE:  # only where config.json alone tells; the load judges the rest
        refuse_other_layers(layer_types_in(json_object(folder / "config.json")) or (), folder)
        check_chat_template(folder)
    shipped = shipped_onnx(folder, options) if runtime is RuntimeKind.ONNX else None
    if shipped is not None:
        if not shipped.is_file():
            raise UnsupportedModel(f"onnx_file {shipped} is not a file")
    elif not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise UnsupportedModel(f"{folder} has no weights file ({', '.join(WEIGHT_FILES)})")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # the Rust library raises a bare Exception with the parser's message
        raise UnsupportedModel(f"{folder}/tokenizer.json cannot be loaded: {exc}") from None
    # Only a load through transformers reads the config with its class: a shipped graph or no-op does not.
    if runtime is RuntimeKind.TORCH or (runtime is RuntimeKind.ONNX and shipped is None):
        check_safetensors_whole(safetensors_files(folder), required=(folder / SAFETENSORS_INDEX).is_file())
        config = json_object(folder / "config.json")
        shapes = safetensors_shapes(safetensors_files(folder))  # the headers, read once for both checks
        _refuse_missing_layers(folder, config, shapes)
        layer_types = judge_config(folder)
        _refuse_misshapen_weights(folder, config, shapes)  # once its class takes the config
        if task is Task.GENERATE:  # the families config.json alone cannot tell, judged as the load judges them
            refuse_other_layers(layer_types or (), folder)
    if task is not Task.GENERATE and runtime is not RuntimeKind.NOOP:  # last: a config its weights refute says more
        refuse_tokens_past_vocab(
            folder, tokenizer.get_vocab(with_added_tokens=False), json_object(folder / "config.json")
        )


def refuse_tokens_past_vocab(folder: Path, vocab: Mapping[str, int], config: Mapping[str, Any]) -> None:
    """Refuse a tokenizer with token ids the model's embedding has no row for (config.json's `vocab_size`, which the
    weights are held to above): an encoder looks up every id of every input and its padding, so a folder given
    another model's tokenizer registered 201 and then dead-lettered every request with "index out of range in
    self" (tester h189). A `vocab_size` larger than the tokenizer is padding, and fine. Not for a generator: its
    tokenizer may carry added tokens past its embedding that prompts never hold (a pad token added without resizing
    the model, say), with which it serves, and `runtimes/generate.py` refuses a prompt that holds one. The regular
    vocabulary only: added special tokens may lie past the embedding in a model's own tokenizer (Gemma 3's, and so
    EmbeddingGemma's, `<image_soft_token>` at id `vocab_size`: review h193), which text seldom holds. `vocab` is
    the tokenizer's regular vocabulary (token to id). The encoder runtime checks again at load, for a model of a
    box's config file, which start-up does not judge (review h201)."""
    rows = config.get("vocab_size")
    if not isinstance(rows, int) or isinstance(rows, bool):
        return
    past = sorted((index, token) for token, index in vocab.items() if index >= rows)
    if past:
        top, token = past[-1]
        which = "a token" if len(past) == 1 else f"{len(past):,} tokens"
        raise UnsupportedModel(
            f"{folder}/tokenizer.json has {which} which the model does not have, "
            f"{'id' if len(past) == 1 else 'up to id'} {top} ({token!r}), where config.json's vocab_size is {rows} "
            "(the rows of its token embedding): its tokenizer does not match it. Put the model's own tokenizer in "
            "the folder"
        )


# A layer's index in a weight's name, as transformers names the repeated blocks (`encoder.layer.3.`, `model.layers.3.`).
# Not T5's `num_layers`: its weights number blocks and the layers inside them (`block.3.layer.1.`).
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers?|h)\.(\d+)\.")  # GPT-2's blocks are `h.3.`


def _refuse_missing_layers(folder: Path, config: Mapping[str, Any], shapes: Mapping[str, list[int]]) -> None:
    """Refuse a config.json that describes more layers than the weights hold: transformers would fill the rest
    with random values and the model would answer nonsense. Read from the safetensors headers, without torch; the
    load checks every weight (runtimes/torch_backend.py), this is the case that is cheap to see before it."""
    # The family's name for it (GPT-2's n_layer, DistilBERT's n_layers), without transformers: no torch on a gateway.
    field = next((name for name in _LAYER_FIELDS if name in config), "num_hidden_layers")
    layers = config.get(field)
    if not isinstance(layers, int) or isinstance(layers, bool):
        return
    found = {int(match.group(1)) for name in shapes if (match := _LAYER_INDEX.search(name))}
    if found and max(found) + 1 < layers:
        raise UnsupportedModel(
            f"the weights in {folder} do not cover the model its config.json describes: it says "
            f"{field} {layers}, the weights hold {max(found) + 1} layers; transformers would fill the "
            "rest with random values. The folder's config.json and weights do not match"
        )


_WIDTH_FIELDS = ("hidden_size", "n_embd", "d_model", "dim")
_EMBEDDING = re.compile(r"(?:^|\.)(?:word_embeddings|embed_tokens|wte)\.weight$")
# The weight whose rows are a classification head's labels, per head layout (a Linear, RoBERTa's two-layer head, a
# decoder's score).
HEAD_WEIGHTS = ("classifier.weight", "classifier.out_proj.weight", "score.weight")


def head_labels(config: Mapping[str, Any]) -> tuple[int, str] | None:
    """The number of labels a model's config.json gives its head, and the field that says so, as transformers reads
    them (`id2label` before `num_labels`); None when it says neither."""
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels), "id2label"
    count = config.get("num_labels")
    if isinstance(count, int) and not isinstance(count, bool):
        return count, "num_labels"
    return None


def _refuse_misshapen_weights(folder: Path, config: Mapping[str, Any], shapes: Mapping[str, list[int]]) -> None:
    """Refuse a config.json whose sizes its weights do not have: a width (`hidden_size`), a vocabulary or a head's
    label count edited by hand (5 labels in `id2label` for a 3-label head), which every load then failed on (a 503
    to every request, after a 201: black-box finding). Read from the safetensors headers, without torch: the token
    embedding's rows and columns, and a classification head's rows."""
    if not shapes:
        return
    width_field = next((name for name in _WIDTH_FIELDS if isinstance(config.get(name), int)), None)
    expected: list[tuple[str, int, int, str]] = []  # tensor, dimension, size, what config.json says
    for name, shape in shapes.items():
        if len(shape) == 2 and _EMBEDDING.search(name):
            if isinstance(config.get("vocab_size"), int):
                expected.append((name, 0, config["vocab_size"], f"vocab_size {config['vocab_size']}"))
            width = "embedding_size" if isinstance(config.get("embedding_size"), int) else width_field
            if width is not None:
                expected.append((name, 1, config[width], f"{width} {config[width]}"))
    if (labels := head_labels(config)) is not None:
        count, source = labels
        for head in HEAD_WEIGHTS:
            if len(shapes.get(head, ())) == 2:
                expected.append((head, 0, count, f"{count} labels ({source})"))
    for name, dim, size, says in expected:
        if shapes[name][dim] != size:
            raise UnsupportedModel(
                f"the weights in {folder} do not match its config.json: {name} is {shapes[name]}, where config.json "
                f"says {says}; transformers cannot load them. The folder's config.json and weights do not match"
            )


def json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object, or `UnsupportedModel` saying what it holds instead."""
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:  # malformed JSON or bytes that are not UTF-8
        raise UnsupportedModel(f"{path.name} in {path.parent} is not valid JSON: {exc}") from None
    except RecursionError:  # nested deeper than the parser goes
        raise UnsupportedModel(f"{path.name} in {path.parent} is nested too deeply to read") from None
    if not isinstance(value, dict):
        raise UnsupportedModel(f"{path.name} in {path.parent} must hold a JSON object, not {json.dumps(value)[:60]}")
    return value
