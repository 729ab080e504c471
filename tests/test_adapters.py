"""LoRA adapters on a serving box: deleted and registered again, more in use than the cap, what the API
says about them. A real box on a real NATS, a random-weight classifier and peft adapters made for it."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import nats
import orjson
import pytest
from prometheus_client import generate_latest

from appliance import bus
from appliance.envelope import ReplyMeta, RequestMeta
from runtimes import Task
from tests.conftest import url, wait_for
from tests.models import make_adapter

TEXTS = ["a fine film, all in all", "what a waste of an evening"]


@pytest.fixture(scope="module")
def classifier_adapters(classifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [
        make_adapter(Task.CLASSIFY, classifier_dir, tmp_path_factory.mktemp(f"cls-lora-{i}"), seed=40 + i)
        for i in range(3)
    ]


async def call(http, box, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with http.request(method, url(box, path), json=body) as response:
        return response.status, await response.json()


async def classify(http, box, model: str) -> tuple[int, dict]:
    return await call(http, box, "POST", "/v1/classify", {"model": model, "input": TEXTS})


async def classifier_box(start_box, http, classifier_dir: Path, **batching: int):
    box = await start_box(default_model=False, model_roots=[classifier_dir.parent.parent])
    status, body = await call(http, box, "POST", "/v1/models", {"name": "cls", "path": str(classifier_dir), **batching})
    assert status == 201, body
    return box


async def register_adapter(http, box, name: str, folder: Path) -> None:
    status, body = await call(http, box, "POST", "/v1/models", {"name": name, "path": str(folder), "adapter_of": "cls"})
    assert status == 201, body


async def answers_as_sent(box, sent: dict[str, tuple[int, int]]) -> dict[str, tuple[int, dict]]:
    """Requests for adapter `cls:x` put in the queue as gateways sent them, `id: (the registration the gateway
    resolved, 0 none said; when it sent it, by its clock)`, and their answers as a stand-in gateway takes them."""
    nc = await nats.connect(box.nats_url)
    replies: asyncio.Queue = asyncio.Queue()

    async def gateway(msg) -> None:
        if msg.reply:
            await msg.respond(b"")
        await replies.put((ReplyMeta.from_headers(msg.headers), msg.data))

    try:
        await nc.subscribe("test.sent", cb=gateway)
        deadline = int(time.time() * 1000) + 30_000
        for request_id, (registration, sent_ms) in sent.items():
            meta = RequestMeta(
                id=request_id,
                task="classify",
                model="cls",
                reply="test.sent",
                deadline_ms=deadline,
                sent_ms=sent_ms,
                adapter="cls:x",
                adapter_registered_ms=registration,
            )
            body = orjson.dumps({"model": "cls:x", "input": TEXTS})
            await box.js.publish(bus.request_subject("cls"), body, headers=meta.headers())
        answers: dict[str, tuple[int, dict]] = {}
        while len(answers) < len(sent):
            reply, body = await asyncio.wait_for(replies.get(), 30)
            answers[reply.id] = (reply.status, orjson.loads(body))
        return answers
    finally:
        await nc.close()


async def test_a_request_whose_adapter_was_deleted_while_it_waited_is_told_so(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """Review h197: a request queued for an adapter deleted before a worker took it was answered "model 'cls:x' does
    not exist; available models: ...", as if the client had named no such model, where a request for a deleted
    model is told it was deleted while it waited. Its gateway resolved the adapter (a gateway refuses one it does not
    know): a registration it names (asked again twice first, as one not heard of yet) or none (a config file's)."""
    box = await classifier_box(start_box, http, classifier_dir)
    await register_adapter(http, box, "cls:x", classifier_adapters[0])
    registered = box.catalog.get("cls:x").registered_ms
    assert (await call(http, box, "DELETE", "/v1/models/cls:x"))[0] == 200
    answers = await answers_as_sent(box, {"resolved": (registered, registered), "config": (0, registered)})
    for request_id, (status, answer) in answers.items():
        assert (status, answer["error"]["code"]) == (404, "model_not_found"), (request_id, answer)
    deleted = "adapter 'cls:x' was deleted while this request waited for it"
    assert answers["resolved"][1]["error"]["message"] == deleted
    # No registration said (a config file's): this box's config may not list it (review h201).
    assert answers["config"][1]["error"]["message"].startswith(
        "adapter 'cls:x' is not in the catalog of the box that took this request: deleted while it waited, or a "
        "config file's adapter that this box's config file does not list"
    ), answers["config"]


def loaded_adapters(box) -> tuple[str, ...]:
    """The names of the adapters the runtime has loaded (it knows them by keys of their own)."""
    resident = box.residency.get("cls")
    if resident is None:
        return ()
    table = resident.adapters
    entries = [*table._entries.values(), *table._in_flight] if table is not None else []  # in flight: unloading
    names = {entry.key: entry.spec.name for entry in entries}
    return tuple(names.get(key, key) for key in resident.runtime.adapters)


async def test_a_deleted_adapter_is_unloaded_and_its_name_registered_again_serves_the_new_folder(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """The delete left the adapter loaded (holding one of the base's slots), and a registration of the
    same name on another folder was served the old adapter's weights for as long as the base stayed."""
    box = await classifier_box(start_box, http, classifier_dir)
    first, second = classifier_adapters[:2]
    await register_adapter(http, box, "cls:b", second)
    _, expected_second = await classify(http, box, "cls:b")
    await register_adapter(http, box, "cls:a", first)
    status, with_first = await classify(http, box, "cls:a")
    assert status == 200 and with_first["data"] != expected_second["data"]

    assert (await call(http, box, "DELETE", "/v1/models/cls:a"))[0] == 200
    await wait_for(lambda: "cls:a" not in loaded_adapters(box), what="the deleted adapter to be unloaded")
    assert loaded_adapters(box) == ("cls:b",)
    await register_adapter(http, box, "cls:a", second)
    status, again = await classify(http, box, "cls:a")
    assert status == 200, again
    assert again["data"] == expected_second["data"]


async def test_an_adapter_registered_again_at_once_after_its_deletion_is_not_said_resident(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """Tester h80: the 201 of the new registration said `resident` on this box: the box read its own heartbeat,
    up to a beat old, which still listed the deleted adapter loaded."""
    box = await classifier_box(start_box, http, classifier_dir)
    await register_adapter(http, box, "cls:c", classifier_adapters[2])
    assert (await classify(http, box, "cls:c"))[0] == 200

    def heard_loaded() -> bool:
        records = [record for record in box.fleet.live_boxes() if record["box"] == box.box_id]
        return any("cls:c" in (model.get("adapters") or ()) for record in records for model in record["models"])

    await wait_for(heard_loaded, what="the box's heartbeat to list the adapter loaded")
    assert (await call(http, box, "DELETE", "/v1/models/cls:c"))[0] == 200
    body = {"name": "cls:c", "path": str(classifier_adapters[2]), "adapter_of": "cls"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert status == 201, answer
    assert (answer["state"], answer["boxes"]) == ("cold", []), answer


async def test_adapters_in_use_are_not_evicted_for_another(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """With the cap reached, a newcomer evicted the least recently used adapter while its request waited
    in the batcher: that request failed 422 bad_adapter, naming the evicted adapter."""
    box = await classifier_box(start_box, http, classifier_dir, max_wait_ms=1000, max_batch_size=64)
    box.residency._max_adapters = 1  # the cap (8) reached with two adapters
    first, second = classifier_adapters[:2]
    await register_adapter(http, box, "cls:a", first)
    await register_adapter(http, box, "cls:b", second)
    _, alone_a = await classify(http, box, "cls:a")
    _, alone_b = await classify(http, box, "cls:b")

    waiting = asyncio.create_task(classify(http, box, "cls:a"))  # its batch waits up to 1 s for company
    await wait_for(lambda: box.workers["cls"].batcher.pending_interactive > 0, what="cls:a's rows in the batcher")
    status_b, with_b = await classify(http, box, "cls:b")
    status_a, with_a = await waiting
    assert (status_a, status_b) == (200, 200), (with_a, with_b)
    assert with_a["data"] == alone_a["data"] and with_b["data"] == alone_b["data"]
    # Not even a batch failed and was tried again (a redelivery) on the way.
    assert not box.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": "cls"})


async def test_many_adapters_asked_at_once_each_answer(start_box, http, classifier_dir, classifier_adapters) -> None:
    """Two loads past the cap at once chose the same victim: the second failed 422 bad_adapter, naming it."""
    box = await classifier_box(start_box, http, classifier_dir)
    box.residency._max_adapters = 1
    names = [f"cls:{i}" for i in range(len(classifier_adapters))]
    for name, folder in zip(names, classifier_adapters, strict=True):
        await register_adapter(http, box, name, folder)
    alone = {name: (await classify(http, box, name))[1]["data"] for name in names}
    for _ in range(3):
        answers = await asyncio.gather(*(classify(http, box, name) for name in names))
        assert [status for status, _ in answers] == [200] * len(names), answers
        assert [body["data"] for _, body in answers] == [alone[name] for name in names]
    assert not box.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": "cls"})
    evicted = {
        sample.labels["model"]
        for metric in box.metrics.registry.collect()
        if metric.name == "fbx_model_evictions"
        for sample in metric.samples
        if sample.name == "fbx_model_evictions_total"
    }
    assert evicted and evicted <= set(names)  # labelled with the adapter's name, not "cls:cls:0"


async def test_an_adapter_says_where_it_is_loaded_and_refuses_evict_and_unpin(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    box = await classifier_box(start_box, http, classifier_dir)
    box.residency._max_adapters = 1
    await register_adapter(http, box, "cls:a", classifier_adapters[0])
    await register_adapter(http, box, "cls:b", classifier_adapters[1])
    _, record = await call(http, box, "GET", "/v1/models/cls:a")
    assert record["state"] == "cold" and record["boxes"] == []
    assert (await classify(http, box, "cls:a"))[0] == 200
    _, record = await call(http, box, "GET", "/v1/models/cls:a")
    assert record["state"] == "resident" and record["boxes"] == [box.box_id], record
    for verb in ("evict", "unpin"):
        status, body = await call(http, box, "POST", f"/v1/models/cls:a/{verb}")
        assert status == 409 and body["error"]["code"] == "conflict", (verb, body)
        assert "cls:a" in loaded_adapters(box)

    assert (await classify(http, box, "cls:b"))[0] == 200  # past the cap: cls:a makes room
    _, record = await call(http, box, "GET", "/v1/models/cls:a")
    assert record["state"] == "cold" and record["boxes"] == []


async def test_an_adapter_of_a_base_a_profile_runs_on_onnx_is_served_on_torch(
    start_box, http, encoder_dir, adapter_dirs, tmp_path
) -> None:
    """The base, loaded on ONNX by its profile before it had adapters, stayed there: 201 for the adapter,
    then 422 "LoRA adapters need the torch runtime" at every use until the base was evicted by hand."""
    from appliance.devices import hardware_slug
    from appliance.profiles import Profile
    from runtimes import RuntimeKind

    hardware = hardware_slug("cpu")
    Profile(
        model="enc", hardware=hardware, runtime="onnx", dtype="float32",
        max_batch_tokens=4096, max_batch_size=32, max_wait_ms=0.0, threads=1,
    ).write(tmp_path / "profiles" / "enc" / f"{hardware}.toml")  # fmt: skip
    roots = [encoder_dir.parent.parent]
    box = await start_box(default_model=False, model_roots=roots, profiles_dir=tmp_path / "profiles")
    assert (await call(http, box, "POST", "/v1/models", {"name": "enc", "path": str(encoder_dir)}))[0] == 201
    status, base = await call(http, box, "POST", "/v1/embeddings", {"model": "enc", "input": TEXTS})
    assert status == 200 and box.residency.get("enc").spec.runtime is RuntimeKind.ONNX

    registration = {"name": "enc:tuned", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "enc"}
    assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201

    def on_torch() -> bool:
        resident = box.residency.get("enc")
        return resident is not None and resident.spec.runtime is RuntimeKind.TORCH and "enc" in box.workers

    await wait_for(on_torch, what="the base to be loaded again on torch")
    status, tuned = await call(http, box, "POST", "/v1/embeddings", {"model": "enc:tuned", "input": TEXTS})
    assert status == 200, tuned
    assert tuned["data"] != base["data"]


async def test_a_deleted_adapter_is_unloaded_on_every_box_that_holds_it(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    first = await classifier_box(start_box, http, classifier_dir)
    second = await start_box(default_model=False, model_roots=[classifier_dir.parent.parent])
    await register_adapter(http, first, "cls:a", classifier_adapters[0])
    for box in (first, second):  # loaded on each (a request would land on either)
        await wait_for(lambda box=box: box.catalog.get("cls:a") is not None, what="the catalog to reach the box")
        await box.workers.serve(box.catalog.get("cls"))
        (await box.residency.hold_adapter("cls", box.catalog.get("cls:a"))).release()
        assert loaded_adapters(box) == ("cls:a",)
    assert (await call(http, first, "DELETE", "/v1/models/cls:a"))[0] == 200
    for box in (first, second):
        await wait_for(lambda box=box: loaded_adapters(box) == (), what=f"cls:a to leave {box.box_id}")


@pytest.mark.parametrize(
    "change",
    [{"init_lora_weights": "pissa"}, {"bias": "all"}, {"task_type": "CAUSAL_LM"}, {"task_type": "TOKEN_CLS"}],
    ids=["pissa", "bias", "generator-adapter", "extractor-adapter"],
)
async def test_an_adapter_that_would_change_its_shared_base_or_is_for_another_task_is_refused_at_registration(
    start_box, http, classifier_dir, classifier_adapters, tmp_path, change: dict
) -> None:
    """Judged from adapter_config.json (the load judges it again): it was a 201, then wrong answers or failures;
    an adapter peft saved for another kind of model (its task_type) was a 201 too."""
    box = await classifier_box(start_box, http, classifier_dir)
    folder = classifier_dir.parent / f"edited-{tmp_path.name}"
    shutil.copytree(classifier_adapters[0], folder)
    config = json.loads((folder / "adapter_config.json").read_text()) | change
    (folder / "adapter_config.json").write_text(json.dumps(config))
    body = {"name": "cls:edited", "path": str(folder), "adapter_of": "cls"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert (status, answer["error"]["code"]) == (422, "unsupported_adapter"), answer


async def test_a_dora_adapter_of_a_classifier_is_registered_and_served(
    start_box, http, classifier_dir, classifier_adapters, tmp_path
) -> None:
    """DoRA was refused for every base (peft cannot apply it per row); an encoder's batch runs one adapter, so a
    classifier's DoRA adapter is served (its answers checked against peft in tests/runtimes/test_lora.py)."""
    box = await classifier_box(start_box, http, classifier_dir)
    folder = make_adapter(
        Task.CLASSIFY, classifier_dir, classifier_dir.parent / f"dora-{tmp_path.name}", 7, use_dora=True
    )
    await register_adapter(http, box, "cls:dora", folder)
    status, base = await classify(http, box, "cls")
    assert status == 200, base
    status, tuned = await classify(http, box, "cls:dora")
    assert status == 200, tuned
    assert tuned["data"] != base["data"]


async def test_an_adapter_that_does_not_fit_its_base_or_asks_another_task_is_refused_at_registration(
    start_box, http, classifier_dir, cross_encoder_dir, classifier_adapters, tmp_path
) -> None:
    """A reranker's 1-label head copy on a 3-label classifier was a 201, then a 422 with torch's size-mismatch text
    on every request; a `task` other than the base's was dropped silently. Found by the black-box tester."""
    box = await classifier_box(start_box, http, classifier_dir)
    folder = classifier_dir.parent / f"reranker-lora-{tmp_path.name}"
    make_adapter(Task.SCORE, cross_encoder_dir, folder, seed=71)
    body = {"name": "cls:reranker", "path": str(folder), "adapter_of": "cls"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert (status, answer["error"]["code"]) == (422, "unsupported_adapter"), answer
    assert "another head" in answer["error"]["message"], answer
    body = {"name": "cls:a", "path": str(classifier_adapters[0]), "adapter_of": "cls", "task": "extract"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert (status, answer["error"]["code"]) == (422, "wrong_task"), answer
    body["task"] = "classify"
    assert (await call(http, box, "POST", "/v1/models", body))[0] == 201


async def test_an_adapter_of_an_adapter_a_route_ambiguous_alias_and_an_adapter_dtype_are_refused_clearly(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """An adapter named as a base was a 404 'does not exist' (it exists); aliases like 'pin' or 'x/../y' were
    taken, unreachable by their routes; an adapter's dtype was taken and ignored. Found by the black-box tester."""
    box = await classifier_box(start_box, http, classifier_dir)
    await register_adapter(http, box, "cls:a", classifier_adapters[0])
    body = {"name": "cls:a:b", "path": str(classifier_adapters[1]), "adapter_of": "cls:a"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert status == 422 and "an adapter's base is a model" in answer["error"]["message"], answer
    body = {"name": "cls:f16", "path": str(classifier_adapters[1]), "adapter_of": "cls", "dtype": "float16"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert status == 422 and "runs in its base model's dtype" in answer["error"]["message"], answer
    body = {"name": "cls:ort", "path": str(classifier_adapters[1]), "adapter_of": "cls", "runtime": "onnx"}
    status, answer = await call(http, box, "POST", "/v1/models", body)  # taken, it was listed and never used (h102)
    assert status == 422 and "runs on its base model's runtime" in answer["error"]["message"], answer
    for alias in ("pin", "x/../y", "a//b"):
        status, answer = await call(http, box, "PATCH", "/v1/models/cls", {"aliases": [alias]})
        assert (status, answer["error"]["code"]) == (422, "invalid_name"), (alias, answer)
        body = {"name": "other", "path": str(classifier_dir), "aliases": [alias]}
        status, answer = await call(http, box, "POST", "/v1/models", body)
        assert (status, answer["error"]["code"]) == (422, "invalid_name"), (alias, answer)


async def test_the_adapter_field_names_the_bases_adapter_before_another_adapters_alias(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """Tester h102: with `m1` an alias of `cls:m0`, `{"model": "cls", "adapter": "m1"}` was answered by cls:m0 (the
    alias looked up first), where the docs address an adapter as its base and its own name."""
    box = await classifier_box(start_box, http, classifier_dir)
    await register_adapter(http, box, "cls:m0", classifier_adapters[0])
    await register_adapter(http, box, "cls:m1", classifier_adapters[1])
    status, answer = await call(http, box, "PATCH", "/v1/models/cls:m0", {"aliases": ["m1"]})
    assert status == 200, answer
    body = {"model": "cls", "adapter": "m1", "input": TEXTS}
    status, by_field = await call(http, box, "POST", "/v1/classify", body)
    assert status == 200 and by_field["model"] == "cls:m1", by_field
    assert (await classify(http, box, "cls:m1"))[1]["data"] == by_field["data"]
    status, by_alias = await classify(http, box, "m1")  # the alias itself still names the adapter it was given to
    assert status == 200 and by_alias["model"] == "cls:m0", by_alias
    # Review: `cls:m2`, registered under no name, was answered by cls:m0 through its alias m2. An unknown model.
    assert (await call(http, box, "PATCH", "/v1/models/cls:m0", {"aliases": ["m1", "m2"]}))[0] == 200
    status, unknown = await classify(http, box, "cls:m2")
    assert (status, unknown["error"]["code"]) == (404, "model_not_found"), unknown
    status, by_field = await call(http, box, "POST", "/v1/classify", {**body, "adapter": "m2"})
    assert status == 200 and by_field["model"] == "cls:m0", by_field  # the field takes a full name or alias


async def test_a_request_sent_before_its_adapter_was_registered_again_is_not_answered_by_the_new_registration(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """Tester h102: requests queued for an adapter whose name was deleted and registered again on another folder were
    answered 200 with the new folder's weights (an adapter's requests share its base's queue, which its deletion
    cannot purge of them). Here requests wait in the queue as their gateways sent them, each with the registration it
    resolved: the one deleted, this one, one this box has not heard of yet, or none said (an older gateway). Review:
    judged by the boxes' clocks (sent before the registration), a gateway's clock behind answered this one's 404."""
    box = await classifier_box(start_box, http, classifier_dir)
    await register_adapter(http, box, "cls:x", classifier_adapters[0])
    registered = box.catalog.get("cls:x").registered_ms
    assert registered > 0
    listed = await call(http, box, "GET", "/v1/models/cls:x")
    assert listed[1]["created"] == registered // 1000, listed  # OpenAI's field: the registration's time now
    # id: (the registration its gateway resolved, 0 none said, and when it was sent by that gateway's clock)
    resolved = {
        "deleted": (registered - 2_000, registered - 60_000),
        "this": (registered, registered - 60_000),  # a gateway whose clock is a minute behind
        "unheard": (registered + 5_000, registered),  # never heard of here: after a few deliveries, as deleted
        "config-before": (0, registered - 1_000),  # no registration said: judged by the clocks
        "config-after": (0, registered + 1),
    }
    redelivered = box.metrics.redelivered.labels("cls")
    before = redelivered._value.get()
    answers = await answers_as_sent(box, resolved)
    for request_id in ("deleted", "unheard", "config-before"):
        status, answer = answers[request_id]
        assert (status, answer["error"]["code"]) == (404, "model_not_found"), (request_id, answer)
        assert answer["error"]["message"] == "adapter 'cls:x' was deleted while this request waited for it"
    assert answers["this"][0] == 200, answers["this"]
    assert answers["config-after"][0] == 200, answers["config-after"]
    # Another registration than this box's was asked again twice (its catalog might not have heard of it yet).
    assert redelivered._value.get() - before == 4


@pytest.mark.parametrize("max_deliver", [1, 2])
async def test_a_request_for_another_registration_is_a_404_within_a_small_max_deliver(
    start_box, http, classifier_dir, classifier_adapters, max_deliver
) -> None:
    """Review h110: handed back for the box's catalog to hear of its registration on its last delivery too, a
    request for a deleted registration was dead-lettered, its client told 422 it failed on every delivery."""
    box = await start_box(default_model=False, model_roots=[classifier_dir.parent.parent], max_deliver=max_deliver)
    assert (await call(http, box, "POST", "/v1/models", {"name": "cls", "path": str(classifier_dir)}))[0] == 201
    await register_adapter(http, box, "cls:x", classifier_adapters[0])
    registered = box.catalog.get("cls:x").registered_ms
    answers = await answers_as_sent(
        box, {"deleted": (registered - 2_000, registered), "unheard": (registered + 5_000, registered)}
    )
    for request_id, (status, answer) in answers.items():
        assert (status, answer["error"]["code"]) == (404, "model_not_found"), (request_id, answer)
    assert box.metrics.dead_lettered.labels("cls")._value.get() == 0


async def test_lora_fields_peft_would_fail_on_are_refused_at_registration(
    start_box, http, classifier_dir, classifier_adapters, tmp_path_factory
) -> None:
    """Tester h102: an adapter_config.json with `r` "four", `lora_alpha` "x", `target_modules` 5 or an `r` of 10^12
    was registered (201, listed), then every request was a 422 in peft's words (`'<=' not supported between
    instances of 'str' and 'int'`), or a load that tried to allocate 128 TB."""
    box = await classifier_box(start_box, http, classifier_dir)
    config = json.loads((classifier_adapters[0] / "adapter_config.json").read_text())
    cases = {
        "r": ("four", 'r is "four"; a whole number from 1 to 65536 is expected'),
        "lora_alpha": ("x", 'lora_alpha is "x"; a number is expected'),
        "target_modules": (5, "target_modules is 5; a module name, a pattern or a list of module names is expected"),
        "rank_pattern": ({"query": "x"}, "rank_pattern['query'] is \"x\"; a whole number from 1 to 65536 is expected"),
    }
    more = [
        ("r", (10**12, "r is 1000000000000; a whole number from 1")),
        ("lora_alpha", (10**400, "... (401 characters); a number is expected")),  # review: float() overflowed, a 500
        # Review: within the cap, above the saved weights' rank, peft allocated at it before reading a weight.
        ("r", (65536, "r is 65536, but the adapter's saved LoRA weights have rank")),
        ("rank_pattern", ({"query": 4096}, "rank_pattern['query'] is 4096, but the adapter's saved LoRA weights")),
        ("r", (1, "r is 1, but the adapter's saved LoRA weights have rank")),  # tester h109: below it, too
        ("rank_pattern", ({"que(ry": 4}, "rank_pattern key 'que(ry' is not a regular expression")),  # peft's re
        # Review h113: an r no saved layer takes still sizes a module target_modules adds without saved weights.
        (
            "r",
            (65536, "r is 65536 and sizes no saved layer"),
            {"rank_pattern": {"query": 4, "value": 4}, "target_modules": ["query", "value", "key"]},
        ),
    ]
    for field, (value, said), *also in [*cases.items(), *more]:
        folder = tmp_path_factory.mktemp(f"bad-{field}")
        shutil.copytree(classifier_adapters[0], folder, dirs_exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(config | {field: value} | (also[0] if also else {})))
        body = {"name": "cls:bad", "path": str(folder), "adapter_of": "cls"}
        status, answer = await call(http, box, "POST", "/v1/models", body)
        assert (status, answer["error"]["code"]) == (422, "unsupported_adapter"), (field, answer)
        assert said in answer["error"]["message"], (field, answer)
    # Review h113: an embedding's LoRA is saved as lora_embedding_A, (r, vocab): its rank is judged too.
    embedding = make_adapter(
        Task.CLASSIFY, classifier_dir, tmp_path_factory.mktemp("embedding") / "lora", seed=9,
        target_modules=["word_embeddings"],
    )  # fmt: skip
    config_file = embedding / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"r": 4096}))
    body = {"name": "cls:bad", "path": str(embedding), "adapter_of": "cls"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    assert (status, answer["error"]["code"]) == (422, "unsupported_adapter"), answer
    said = "r is 4096, but the adapter's saved LoRA weights have rank 4 at bert.embeddings.word_embeddings"
    assert said in answer["error"]["message"], answer
    assert box.catalog.get("cls:bad") is None


async def test_an_adapter_whose_rank_pattern_sets_every_layer_below_r_is_served(
    start_box, http, classifier_dir, tmp_path_factory
) -> None:
    """Review h110: peft writes `r` (8 by default) beside a `rank_pattern` that sets every layer's rank (4 here), and
    loads such an adapter; the registration refused it 422 (`r is 8, but the saved weights have rank 4 at most`)."""
    box = await classifier_box(start_box, http, classifier_dir)
    folder = make_adapter(
        Task.CLASSIFY, classifier_dir, tmp_path_factory.mktemp("ranks") / "lora", seed=7, r=8,
        rank_pattern={"query": 4, "value": 4},
    )  # fmt: skip
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
    await register_adapter(http, box, "cls:ranks", folder)
    status, answer = await classify(http, box, "cls:ranks")
    assert status == 200, answer
    # Review h113: a key as peft's docs write one, anchored on the module's name, which the saved weights' names
    # carry behind a `base_model.model.` prefix.
    anchored = make_adapter(
        Task.CLASSIFY, classifier_dir, tmp_path_factory.mktemp("anchored") / "lora", seed=8, r=4,
        rank_pattern={r"^bert\.encoder\.layer\.0\.attention\.self\.query": 8},
    )  # fmt: skip
    await register_adapter(http, box, "cls:anchored", anchored)
    status, answer = await classify(http, box, "cls:anchored")
    assert status == 200, answer


async def test_an_adapter_that_fails_to_load_says_why_in_its_record(
    start_box, http, classifier_dir, classifier_adapters, tmp_path_factory
) -> None:
    """Tester h102: an adapter whose loads failed (a 422 `bad_adapter` to each request) was listed with `load_error`
    null, where a base model's record says why its load failed. A config peft cannot build from passes the
    registration's checks: its `lora_dropout` is text."""
    box = await classifier_box(start_box, http, classifier_dir)
    folder = tmp_path_factory.mktemp("bad-dropout")
    shutil.copytree(classifier_adapters[0], folder, dirs_exist_ok=True)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"lora_dropout": "high"}))
    await register_adapter(http, box, "cls:bad", folder)
    status, answer = await classify(http, box, "cls:bad")
    assert (status, answer["error"]["code"]) == (422, "bad_adapter"), answer
    status, record = await call(http, box, "GET", "/v1/models/cls:bad")
    assert status == 200 and record["state"] == "failed", record
    assert "does not fit this base model" in (record["load_error"] or ""), record
    assert list(record["load_failed_on"]) == [box.box_id], record


async def test_an_adapter_registered_while_its_base_is_deleted_on_another_box_is_not_left_without_it(
    start_box, http, classifier_dir, classifier_adapters
) -> None:
    """Both calls succeeded and the adapter was left without a base, then inherited by the next model registered
    under the base's name (7 of 20 and 13 of 20 rounds for the black-box tester). Now, whichever way the race
    goes, the adapter goes with its base."""
    from tests.conftest import hold

    here = await classifier_box(start_box, http, classifier_dir)
    there = await start_box(default_model=False, model_roots=[classifier_dir.parent.parent])
    await wait_for(lambda: there.catalog.get("cls") is not None, what="the other box to know the base")
    base = there.catalog.get("cls")

    # The registration writes the adapter, then the other box deletes the base (past the route's check, made
    # before it could know of the adapter): the registration finds its base gone and takes the adapter back.
    written, go_on = hold(here.store, "create", after=True)
    body = {"name": "cls:a", "path": str(classifier_adapters[0]), "adapter_of": "cls"}
    registering = asyncio.create_task(call(http, here, "POST", "/v1/models", body))
    await asyncio.wait_for(written.wait(), 20)
    await there.queue.delete_model(base)
    go_on.set()
    status, answer = await registering
    assert (status, answer["error"]["code"]) == (404, "model_not_found"), answer
    assert await there.store.adapters_in_bucket("cls") == []

    # The other way: the registration saw its base, then the base is deleted: the deletion takes the adapter.
    assert (await call(http, here, "POST", "/v1/models", {"name": "cls", "path": str(classifier_dir)}))[0] == 201
    await register_adapter(http, here, "cls:b", classifier_adapters[1])
    await wait_for(lambda: there.catalog.get("cls") is not None, what="the other box to know the base again")
    assert await there.queue.delete_model(there.catalog.get("cls")) == ["cls:b"]  # said (its registration was a 201)
    assert await there.store.adapters_in_bucket("cls") == []
    await wait_for(lambda: here.catalog.get("cls:b") is None, what="the adapter to leave the catalog")


async def test_a_classifier_base_without_a_head_answers_through_adapters_that_bring_theirs_only(
    start_box, http, classifier_dir: Path, classifier_adapters: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A LoRA base whose folder holds the backbone and no head: each SEQ_CLS adapter carries its own copy. It was
    refused whole (503, base and adapters); called without an adapter, its random head would answer noise (and
    another noise on each load: regression tester), so that is a 422 `untrained_head`. Through an adapter, the
    answer is the adapter's on the complete base (the same backbone, the adapter's head)."""
    from transformers import AutoModelForSequenceClassification

    from benchmarks._models import copy_bert_tokenizer

    headless = tmp_path_factory.mktemp("models") / "headless"
    AutoModelForSequenceClassification.from_pretrained(classifier_dir).bert.save_pretrained(headless)
    config = json.loads((classifier_dir / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps(config))  # the classifier's, over the backbone's weights
    copy_bert_tokenizer(headless)
    box = await start_box(default_model=False, model_roots=[classifier_dir.parent.parent, headless.parent.parent])
    for name, folder in (("cls", classifier_dir), ("bare", headless)):
        assert (await call(http, box, "POST", "/v1/models", {"name": name, "path": str(folder)}))[0] == 201
        body = {"name": f"{name}:a", "path": str(classifier_adapters[0]), "adapter_of": name}
        assert (await call(http, box, "POST", "/v1/models", body))[0] == 201
    status, body = await classify(http, box, "bare")
    assert (status, body["error"]["code"]) == (422, "untrained_head"), body
    assert "classifier.weight" in body["error"]["message"] and "adapters" in body["error"]["message"]
    status, through_bare = await classify(http, box, "bare:a")
    assert status == 200, through_bare
    status, through_complete = await classify(http, box, "cls:a")
    assert status == 200, through_complete
    assert through_bare["data"] == through_complete["data"]
    # An adapter saved without a head copy (no task_type) would answer with the random head (review finding).
    headless_adapter = make_adapter(
        Task.CLASSIFY, classifier_dir, tmp_path_factory.mktemp("no-head"), 3, task_type=None
    )
    body = {"name": "bare:plain", "path": str(headless_adapter), "adapter_of": "bare"}
    status, refused = await call(http, box, "POST", "/v1/models", body)
    assert (status, refused["error"]["code"]) == (422, "unsupported_adapter"), refused
    assert "brings no head" in refused["error"]["message"]
    body = {"name": "cls:plain", "path": str(headless_adapter), "adapter_of": "cls"}  # a base with a trained head
    assert (await call(http, box, "POST", "/v1/models", body))[0] == 201


async def test_a_deleted_adapters_metric_series_go_with_it(
    start_box, http, classifier_dir, classifier_adapters, monkeypatch
) -> None:
    """Tester h70: every adapter registered and deleted left its `fbx_model_loads` and `fbx_model_evictions` series
    for good: /metrics grew with the churn (1,346 to 2,546 series over 300 adapters)."""
    from appliance import catalog_changes

    monkeypatch.setattr(catalog_changes, "_FORGET_METRICS_S", 0.2)
    box = await classifier_box(start_box, http, classifier_dir)
    await register_adapter(http, box, "cls:gone", classifier_adapters[0])
    assert (await classify(http, box, "cls:gone"))[0] == 200

    def series(name: str) -> list[str]:
        exposition = generate_latest(box.metrics.registry).decode()
        return [line for line in exposition.splitlines() if f'model="{name}"' in line]

    assert any(line.startswith("fbx_model_loads_total") for line in series("cls:gone"))
    assert (await call(http, box, "DELETE", "/v1/models/cls:gone"))[0] == 200
    await wait_for(lambda: "cls:gone" not in loaded_adapters(box), what="the deleted adapter to be unloaded")
    await wait_for(lambda: not series("cls:gone"), what="its series to go")
    assert series("cls")  # its base's stay


@pytest.mark.parametrize("base_head", [True, False], ids=["base-with-head", "headless-base"])
async def test_an_adapter_with_a_head_of_other_labels_than_its_base_is_refused_at_registration(
    start_box, http, classifier_dir: Path, tmp_path_factory: pytest.TempPathFactory, base_head: bool
) -> None:
    """Black-box tester: a 2-label head copy (`modules_to_save=["classifier"]`) registered on a 3-label classifier
    was a 201, then every request failed with torch's size-mismatch text; the docs say a head copy must have the
    base's shape (its number of labels). Judged against the base's config.json, whether or not its folder holds a
    head of its own."""
    from transformers import AutoModelForSequenceClassification

    from benchmarks._models import copy_bert_tokenizer

    models = tmp_path_factory.mktemp("models")
    binary = models / "binary"
    AutoModelForSequenceClassification.from_pretrained(
        classifier_dir, id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1},
        ignore_mismatched_sizes=True,
    ).save_pretrained(binary)  # fmt: skip
    adapter = make_adapter(Task.CLASSIFY, binary, models / "binary-lora", 8, modules_to_save=["classifier"])
    base = classifier_dir
    if not base_head:
        base = models / "headless"
        AutoModelForSequenceClassification.from_pretrained(classifier_dir).bert.save_pretrained(base)
        (base / "config.json").write_text((classifier_dir / "config.json").read_text())
        copy_bert_tokenizer(base)
    box = await start_box(default_model=False, model_roots=[base.parent.parent, models.parent])
    assert (await call(http, box, "POST", "/v1/models", {"name": "cls", "path": str(base)}))[0] == 201
    body = {"name": "cls:binary", "path": str(adapter), "adapter_of": "cls"}
    status, answer = await call(http, box, "POST", "/v1/models", body)
    if status == 201:  # what the tester saw: then every request failed
        said = await classify(http, box, "cls:binary")
        pytest.fail(f"registered (201); a request then answered {said}")
    assert (status, answer["error"]["code"]) == (422, "unsupported_adapter"), answer
    message = answer["error"]["message"]
    assert "2 labels" in message and "3 labels" in message, message


async def test_an_adapter_whose_folder_was_deleted_is_not_listed_loaded_and_its_record_says_why(
    start_box, http, classifier_dir: Path, classifier_adapters: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An adapter loaded, then its folder deleted: every request was a 503 `adapter_folder_missing`, while
    `GET /v1/models` and the box's heartbeat went on listing it resident on the box, with `load_error` null."""
    from appliance.box_status import heartbeat

    folder = tmp_path_factory.mktemp("models") / "gone-lora"
    shutil.copytree(classifier_adapters[0], folder)
    box = await start_box(default_model=False, model_roots=[classifier_dir.parent.parent, folder.parent.parent])
    assert (await call(http, box, "POST", "/v1/models", {"name": "cls", "path": str(classifier_dir)}))[0] == 201
    await register_adapter(http, box, "cls:gone", folder)
    assert (await classify(http, box, "cls:gone"))[0] == 200
    _, record = await call(http, box, "GET", "/v1/models/cls:gone")
    assert (record["state"], record["boxes"]) == ("resident", [box.box_id]), record

    shutil.rmtree(folder)
    status, answer = await classify(http, box, "cls:gone")
    assert (status, answer["error"]["code"]) == (503, "adapter_folder_missing"), answer
    _, record = await call(http, box, "GET", "/v1/models/cls:gone")
    # Not a failed load the fleet's readers see (its heartbeat does not say it): `cold`, as the TUI shows it (h225).
    assert (record["state"], record["boxes"], record["load_failed_on"]) == ("cold", [], {}), record
    assert f"its folder {folder} does not exist on this box" in (record["load_error"] or ""), record
    _, listed = await call(http, box, "GET", "/v1/models")
    assert [m["state"] for m in listed["data"] if m["id"] == "cls:gone"] == ["cold"], listed
    beat = {model["name"]: model for model in heartbeat(box)["models"]}
    assert "cls:gone" not in beat["cls"]["adapters"], beat
    assert (await classify(http, box, "cls"))[0] == 200  # the base answers as before
    # Review h110: a gateway-only box loads nothing, and may hold no model files: no folder of its own to miss.
    gateway = await start_box(role="gateway", default_model=False, model_roots=box.settings.model_roots)
    _, record = await call(http, gateway, "GET", "/v1/models/cls:gone")
    assert record["load_error"] is None, record


async def test_an_adapter_addressed_through_its_bases_alias_is_found_by_the_model_routes(
    start_box, http, encoder_dir, adapter_dirs
) -> None:
    """Tester h189: `sentiment:l1` (`sentiment` an alias of `cls`) was answered on the inference routes and 404 on
    `GET /v1/models/{name}` and `DELETE`; the adapter is found, and deleted by its own name only (409, as an alias)."""
    box = await start_box(default_model=False, model_roots=[encoder_dir.parent.parent])
    base = {"name": "enc", "path": str(encoder_dir), "aliases": ["words"]}
    assert (await call(http, box, "POST", "/v1/models", base))[0] == 201
    registration = {"name": "enc:tuned", "path": str(adapter_dirs[Task.EMBED]), "adapter_of": "enc"}
    assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201
    status, record = await call(http, box, "GET", "/v1/models/words:tuned")
    assert status == 200 and record["id"] == "enc:tuned", record
    status, refused = await call(http, box, "DELETE", "/v1/models/words:tuned")
    assert status == 409 and "delete a model by its own name" in refused["error"]["message"], refused
    assert (await call(http, box, "GET", "/v1/models/words:nothing"))[0] == 404
