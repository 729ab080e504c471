"""What a box says about itself: whether it is ready, where a model is resident, and its heartbeat.

Read by `/readyz`, the model routes and the fleet's heartbeats (`fbx_boxes`), which the TUI, the CLI
and every other box's placement read in turn.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from appliance import __version__, bus
from appliance.adapters import missing_folder
from appliance.catalog import DEFAULT_MODEL_NAME, ModelSpec
from appliance.devices import device_name

if TYPE_CHECKING:
    from appliance.app import Box


def not_ready_reason(box: Box) -> str | None:
    """Why this box should not be sent traffic now (`/readyz`), or None when it is ready.

    Its pinned models count until it is first ready (a box is sent traffic with them loaded and warm); after that
    only the default model does: a model pinned on a running fleet took every box out of rotation at once (a
    readiness probe on `/readyz` would have dropped every pod) until it loaded, 16 s for an ONNX export (tester
    h146). Its record says where it loads meanwhile."""
    reason = _not_ready_reason(box)
    if reason is None:
        box.was_ready = True
    return reason


def _not_ready_reason(box: Box) -> str | None:
    if box.nc is None or not box.nc.is_connected:
        return "not connected to NATS"
    if not box.queue.stream_ok:
        return f"stream {bus.REQUEST_STREAM} is not available"
    if box.dispatcher is not None and box.dispatcher.queue_unanswered():
        # Publishes failing or waiting (no stream leader: an election, a quorum lost), which a look at the stream may
        # not see: `/readyz` said ready through 4-6 s elections and 25 s of quorum loss, every request a 503 (h87).
        return f"stream {bus.REQUEST_STREAM} is not answering publishes (a NATS failover?)"
    if box.draining:
        return "draining"
    if box.settings.runs_models:
        for spec in box.catalog:
            if not spec.pinned or spec.adapter_of is not None:
                continue
            if box.was_ready and spec.name != DEFAULT_MODEL_NAME:
                continue
            if not box.residency.is_resident(spec.name):
                # A pinned model whose load failed here would keep every box out of rotation until
                # someone unpins it: it stops counting (its record shows `load_error`). The packaged
                # default model always counts: a box is not ready without it.
                if spec.name != DEFAULT_MODEL_NAME and box.residency.load_error(spec.name) is not None:
                    continue
                return f"pinned model {spec.name} is not resident yet"
            worker = box.workers.get(spec.name)
            if worker is not None and not worker.pulling.is_set():
                # Resident, its worker timing its warm-up batches: until then its heartbeat says no pace, and a
                # gateway bounds a burst by rounds of its batches alone (32 of 200 short requests let in).
                return f"pinned model {spec.name} is warming up"
    return None


def model_state(box: Box, name: str, spec: ModelSpec | None = None, *, draining: bool = False) -> dict[str, Any]:
    """Where a model is resident in the fleet, from this box's own state and the other boxes' heartbeats (its own
    heartbeat is up to a beat old: a load that had just failed read "loading", with its `load_error` beside it).
    `spec`: the model as just changed, where the catalog may not have it yet (a PATCH's answer showed the profile
    its batching had before). A draining box is in `boxes` only with `draining` (an eviction's holders), but its
    `bytes` and `max_length` count: a gateway weighs a generation by the context of a sole holder that drains."""
    spec = spec or box.catalog.get(name)
    if spec is not None and spec.adapter_of is not None:
        return _adapter_state(box, spec, spec.adapter_of)
    boxes, nbytes, loading, max_length = [], None, False, None
    failed_on = _load_failed_on(box, name)
    for record in box.fleet.live_boxes() if box.fleet else []:
        if record.get("box") == box.box_id:
            continue
        counted = draining or not record.get("draining")
        for model in record.get("models", []):
            if model.get("name") == name:
                if model.get("state") != "loading":
                    nbytes = model.get("bytes")
                    max_length = model.get("max_length", max_length)
                    if counted:
                        boxes.append(record["box"])
                elif counted and record["box"] not in failed_on:  # a load tried again after it failed is no news
                    loading = True
    load_error = box.residency.load_error(name)
    resident = box.residency.get(name)
    if resident is not None:
        nbytes = resident.nbytes
        max_length = resident.runtime.info.max_length
        if draining or not box.draining:
            boxes.append(box.box_id)
    if (
        load_error is None
        and not box.draining
        and (box.residency.is_loading(name) or (box.placement is not None and name in box.placement.loading))
    ):
        loading = True
    state = "resident" if boxes else "loading" if loading else "failed" if failed_on else "cold"
    profile = None
    if box.profiles is not None and spec is not None:
        profile = box.profiles.describe(spec, has_adapters=bool(box.catalog.adapters_of(spec.name)))
    return {
        "state": state,
        "boxes": sorted(boxes),
        "bytes": nbytes,
        "max_model_len": max_length,  # vLLM's name: the tokens it takes, a generator's context (prompt and answer)
        "profile": profile,
        "load_error": load_error,
        "load_failed_on": failed_on,
    }


def _other_boxes(box: Box) -> list[dict[str, Any]]:
    """The heartbeat records of the live boxes besides this one that are not draining: where a model is, as the TUI's
    models table and `fleetbox models list` count it (a draining box finishes what it took and takes nothing new)."""
    records = box.fleet.live_boxes() if box.fleet else []
    return [r for r in records if r.get("box") != box.box_id and not r.get("draining")]


def _load_failed_on(box: Box, name: str) -> dict[str, str]:
    """Box -> why its last load of `name` failed, for each live box not draining whose record says so (this one: as
    it is now, its record up to a beat old), as the TUI's models table reads them: no such box holding or newly
    loading the model, it is `failed`, not `cold` (the API said `cold` where the TUI and `fleetbox models list` said
    `failed`)."""
    failed_on = {
        record["box"]: failure.get("error", "")
        for record in _other_boxes(box)
        for failure in record.get("load_failed") or ()
        if failure.get("name") == name
    }
    load_error = box.residency.load_error(name)
    if load_error is not None and not box.draining:
        failed_on[box.box_id] = one_line(load_error, LOAD_ERROR_CHARS)
    return dict(sorted(failed_on.items()))


def _adapter_state(box: Box, spec: ModelSpec, base: str) -> dict[str, Any]:
    """An adapter is resident on the boxes whose heartbeat lists it loaded on its base; on this box, as it holds it
    now (its own heartbeat, up to a beat old, had an adapter deleted and registered again at once resident). Its
    folder gone from this box is its `load_error` here: every request this box takes for it is refused for that."""
    name = spec.name
    boxes = {
        record["box"]
        for record in _other_boxes(box)
        for model in record.get("models", [])
        if model.get("name") == base and name in (model.get("adapters") or ())
    }
    if name in box.residency.adapter_names(base) and not box.draining:
        boxes.add(box.box_id)
    failed_on = _load_failed_on(box, name)
    return {
        "state": "resident" if boxes else "failed" if failed_on else "cold",
        "boxes": sorted(boxes),
        "bytes": None,
        "max_model_len": model_state(box, base)["max_model_len"],  # its base's: it runs in it
        "profile": None,
        # Its folder missing here matters only where it would be loaded: a gateway-only box may hold no model files.
        # Said here alone, not in the heartbeats: not a failed load the fleet's readers see, so not its `state`.
        "load_error": (missing_folder(spec) if box.settings.runs_models else None) or box.residency.load_error(name),
        "load_failed_on": failed_on,
    }


def heartbeat(box: Box) -> dict[str, Any]:
    """This box's record in `fbx_boxes`: what it is, what it holds and how it is doing (also the `status` verb)."""
    models = [
        {
            "name": r.spec.name,
            "bytes": r.nbytes,
            "max_length": r.runtime.info.max_length,
            "dimensions": r.runtime.info.dimensions,  # an embedder's width, for gateways to judge `dimensions`
            "pinned": r.spec.name in box.residency.pinned,
            "state": "resident",
            "adapters": box.residency.adapter_names(r.spec.name),
            **box.workers.stats(r.spec.name),
        }
        for r in box.residency.residents()
    ]
    loading = box.placement.loading if box.placement is not None else set()
    models += [
        {"name": name, "bytes": None, "pinned": False, "state": "loading"}
        for name in box.catalog.names()
        if (box.residency.is_loading(name) or name in loading) and not box.residency.is_resident(name)
    ]
    return {
        "host": socket.gethostname(),
        "role": box.settings.role,
        "version": __version__,
        "build": box.build,
        "started": box.started_at,
        "run": box.run,
        "uptime_s": round(time.time() - box.started_at, 1),
        "draining": box.draining,
        "http_port": box.http_port,
        "devices": [
            {
                "name": device_name(box.device) if box.settings.runs_models else "none",
                "device": box.device,
                "budget_bytes": box.residency.budget_bytes,
                "used_bytes": box.residency.used_bytes,
            }
        ],
        "models": models,
        "load_failed": load_failures(box),
        "backlog": box.queue.backlog,
    }


LOAD_FAILED_MAX = 16  # models a heartbeat names as failing to load here (the newest): the record stays small
LOAD_ERROR_CHARS = 200  # of each one's error, on one line: the whole is `GET /v1/models/{name}`'s `load_error`


def load_failures(box: Box) -> list[dict[str, Any]]:
    """The models whose last load on this box failed, with why (one line, cut) and when: a separate field, not
    entries of `models`, which placement and admission read as held or on their way. A load that fails between two
    beats (a corrupt folder fails in ms) left no trace in the fleet's records: the TUI showed such a model `cold`
    with no error (tester h212). Kept while a load tried again runs; gone once one succeeds or the model is
    deleted or registered again differently (`Residency.forget_load_error`)."""
    return [
        {"name": name, "error": one_line(why, LOAD_ERROR_CHARS), "at": round(at, 3)}
        for name, why, at in box.residency.load_failures()[:LOAD_FAILED_MAX]
    ]


def one_line(text: str, limit: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
