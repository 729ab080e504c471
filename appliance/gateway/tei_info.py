"""TEI's `GET /info`: what a TEI server says of its one model and its limits, said of a fleetbox model.

Only what this gateway truly knows fills a field: the catalog's spec (name, dtype, batching), the box's settings
(its limits), and the model folder's own files when this gateway can read the folder (the pooling, the labels,
the longest input). Anything else (the weights' hub commit, tokenizer threads a TEI router runs) is null, never
a guess; a folder this gateway cannot read leaves its fields null too.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from aiohttp import web

from appliance import __version__
from appliance.build import build_id
from appliance.catalog import ModelSpec
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import json_response
from appliance.gateway.tei import tei_model
from runtimes import Task
from runtimes.base import UnsupportedModel
from runtimes.tasks.classify import labels_from_config
from runtimes.tasks.embed import EmbedHead
from runtimes.tokenizer import model_max_length

# TEI's name for each task's kind of model (its `model_type` key).
_MODEL_TYPE = {Task.EMBED: "embedding", Task.CLASSIFY: "classifier", Task.SCORE: "reranker"}


async def info(request: web.Request) -> web.Response:
    """`GET /info`: of the model `POST /` serves without a `model` (the fleet's one encoder model)."""
    ctx = GatewayContext.of(request)
    return json_response(await model_info(ctx, tei_model(ctx, "GET /info")))


async def model_info(ctx: GatewayContext, spec: ModelSpec) -> dict[str, Any]:
    """TEI's `Info` for `spec`, its folder read in an executor (file I/O off the loop): an adapter's base folder,
    whose tokenizer, labels and length the adapter runs with (tester h96: an adapter's fields were null)."""
    base = ctx.catalog.get(spec.adapter_of) if spec.adapter_of is not None else None
    folder = spec if base is None else replace(spec, path=base.path)
    kind, max_input_length = await asyncio.get_running_loop().run_in_executor(None, _from_folder, folder)
    batching = ctx.catalog.batching_for(spec)
    return {
        "model_id": spec.name,
        "model_sha": None,  # a local folder: no hub commit
        "model_dtype": spec.dtype,
        "model_type": {_MODEL_TYPE[spec.task]: kind},
        "served_model_name": spec.name,
        "max_concurrent_requests": ctx.settings.max_waiting,
        "max_input_length": max_input_length,
        "max_batch_tokens": batching.max_batch_tokens,
        "max_batch_requests": batching.max_batch_size,
        "max_client_batch_size": ctx.settings.max_inputs,
        "auto_truncate": True,  # an encoder request's `truncate` is true unless it says otherwise
        "tokenization_workers": None,  # each box tokenises in its batcher's threads: no pool of TEI's kind
        "version": __version__,
        "sha": build_id(),  # the commit of fleetbox's code (`appliance.build`), as TEI says its own
        "docker_label": None,
    }


def _from_folder(spec: ModelSpec) -> tuple[dict[str, Any], int | None]:
    """The model type's details and the longest input, from the folder's files; nulls where it cannot be read."""
    empty = {"pooling": None} if spec.task is Task.EMBED else {"id2label": None, "label2id": None}
    if not spec.path.is_dir():  # another box's folder (a gateway-only box), or gone: no defaults to stand for it
        return empty, None
    try:
        if spec.task is Task.EMBED:
            pooling = EmbedHead.from_folder(spec.path, weights=False).pooling
            kind: dict[str, Any] = {"pooling": "+".join(mode.value for mode in pooling)}
        else:
            labels = labels_from_config(json.loads((spec.path / "config.json").read_text()))
            kind = {
                "id2label": {str(index): label for index, label in enumerate(labels)},
                "label2id": {label: index for index, label in enumerate(labels)},
            }
        return kind, model_max_length(spec.path)
    except (OSError, ValueError, UnsupportedModel):  # not readable from this gateway, or not what a load reads
        return empty, None
