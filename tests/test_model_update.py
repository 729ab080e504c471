"""`PATCH /v1/models/{name}` (and `fleetbox models update`): aliases, the pin and batching knobs changed in place,
on real boxes sharing one real NATS."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from nats.js.errors import KeyNotFoundError
from typer.testing import CliRunner

from appliance import bus, cli
from appliance.batcher import Batcher
from appliance.catalog import Batching, ModelChange
from appliance.devices import hardware_slug
from appliance.errors import NotFound
from appliance.metrics import Metrics
from appliance.model_update import NEEDS_REGISTRATION, change_model
from appliance.profiles import Profile
from appliance.schemas import ModelUpdate
from appliance.settings import MAX_BATCH_SIZE, MAX_BATCH_TOKENS, ModelEntry
from tests.conftest import hold, noop_model, url, wait_for
from tests.test_batcher import RecordingRuntime, job

ADMIN = {"Authorization": "Bearer admin-secret"}


async def call(http, box, method: str, path: str, body: object = None, headers=None) -> tuple[int, dict]:
    async with http.request(method, url(box, path), json=body, headers=headers) as response:
        return response.status, await response.json()


def noop(name: str, *, pinned: bool = True, aliases: list[str] | None = None, task: str | None = None) -> ModelEntry:
    """A model on the no-op runtime, with aliases or a task (`noop_model` takes runtime options)."""
    return ModelEntry(name=name, runtime="noop", pinned=pinned, aliases=aliases or [], task=task)


def batches(box, model: str) -> tuple[float, float]:
    """(batches run, rows run) for a model on this box, from its metrics."""
    get = box.metrics.registry.get_sample_value
    labels = {"model": model}
    return get("fbx_batch_size_count", labels) or 0.0, get("fbx_batch_size_sum", labels) or 0.0


async def test_batching_changed_on_a_resident_model_is_used_at_once_without_a_reload(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("m")])
    runtime = box.residency.get("m").runtime
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "m", "input": ["a", "b", "c", "d"]}))[0] == 200
    assert batches(box, "m") == (1.0, 4.0)  # one batch of four rows
    status, record = await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 1, "max_wait_ms": 2.5})
    assert status == 200, record
    assert (record["batching"]["max_batch_size"], record["batching"]["max_wait_ms"]) == (1, 2.5)
    assert record["batching"]["max_batch_tokens"] == box.settings.max_batch_tokens  # kept
    await wait_for(lambda: box.workers["m"].batcher.batching.max_batch_size == 1, what="the batcher retuned")
    assert box.workers["m"].batcher.batching.max_wait_ms == 2.5
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "m", "input": ["a", "b", "c", "d"]}))[0] == 200
    assert batches(box, "m") == (5.0, 8.0)  # then four batches of one row
    assert box.residency.get("m").runtime is runtime  # the same load
    assert box.metrics.registry.get_sample_value("fbx_model_loads_total", {"model": "m"}) == 1


async def test_a_change_made_while_the_model_loads_reaches_the_worker_it_gets(start_box, http) -> None:
    """The catalog's watch finds no worker to retune while the load runs; the worker started after it must not
    keep the batching its load began with."""
    box = await start_box(default_model=False, models=[noop("m", pinned=False)])
    loading, release = hold(box.residency, "ensure_loaded")
    serving = asyncio.create_task(box.workers.serve(box.catalog.get("m")))
    await asyncio.wait_for(loading.wait(), 10)
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 3}))[0] == 200
    release.set()
    worker = await serving
    assert worker.batcher.batching.max_batch_size == 3 and worker.spec.batching.max_batch_size == 3


async def test_a_batch_waiting_for_company_ends_its_wait_by_the_new_max_wait_ms() -> None:
    """The batcher alone, with the no-op runtime (its wait is under test)."""
    runtime, finished = RecordingRuntime(), asyncio.Event()
    with ThreadPoolExecutor(1) as executor:
        batcher = Batcher("m", runtime, Batching(16384, 8, 10_000.0), executor, Metrics(), lambda j, e: finished.set())
        batcher.submit(job([4]))
        batcher.start()
        await wait_for(lambda: not batcher._wake.is_set(), what="the lone row waiting for company")
        started = time.monotonic()
        batcher.retune(Batching(16384, 8, 0.0, concurrent_batches=4))
        await asyncio.wait_for(finished.wait(), 10)
        assert time.monotonic() - started < 5.0  # not the 10 s it was waiting for
        assert batcher.batching.concurrent_batches == 1  # its threads stay as they were made
        await batcher.drain()
    assert runtime.batches == [[4]]


async def test_a_second_box_sees_the_change_and_retunes_its_own_batcher(start_box, http) -> None:
    a = await start_box(default_model=False, models=[noop("m", aliases=["old"])])
    b = await start_box(default_model=False, models=[noop("m", aliases=["old"])])
    assert "m" in b.workers
    status, _ = await call(http, a, "PATCH", "/v1/models/m", {"aliases": ["new"], "max_batch_tokens": 99})
    assert status == 200
    await wait_for(lambda: b.catalog.get("new") is not None and b.catalog.get("old") is None, what="b's catalog")
    await wait_for(lambda: b.workers["m"].batcher.batching.max_batch_tokens == 99, what="b's batcher retuned")
    assert b.workers["m"].spec.batching.max_batch_tokens == 99


async def test_aliases_are_replaced_and_judged_as_a_registration_judges_them(start_box, http) -> None:
    box = await start_box(
        default_model=False,
        models=[noop("m", aliases=["old"]), noop("other", pinned=False, aliases=["taken"])],
    )
    status, record = await call(http, box, "PATCH", "/v1/models/m", {"aliases": ["new", "newer"]})
    assert (status, record["aliases"]) == (200, ["new", "newer"]), record
    status, body = await call(http, box, "POST", "/v1/embeddings", {"model": "old", "input": "x"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert (await call(http, box, "POST", "/v1/embeddings", {"model": "new", "input": "x"}))[0] == 200
    assert (await call(http, box, "GET", "/v1/models/newer"))[1]["id"] == "m"
    refused = [
        (["taken"], 409, "model_exists", "'taken' is taken: model 'other' has it as an alias"),
        (["other"], 409, "model_exists", "model 'other' has it as its name"),
        (["m"], 422, "invalid_input", "is the model's own name"),
        (["x", "x"], 422, "invalid_input", "given twice"),
        ([""], 422, "invalid_input", "$.aliases[0]"),
        ([f"a{i}" for i in range(65)], 422, "invalid_input", "at most 64 aliases"),
    ]
    for aliases, status, code, words in refused:
        got, body = await call(http, box, "PATCH", "/v1/models/m", {"aliases": aliases})
        assert (got, body["error"]["code"]) == (status, code), (aliases, body)
        assert words in body["error"]["message"], (aliases, body)
    assert box.catalog.get("m").aliases == ("new", "newer")  # nothing refused was written
    status, record = await call(http, box, "PATCH", "/v1/models/other", {"aliases": ["old"]})  # freed by m
    assert (status, record["aliases"]) == (200, ["old"]), record
    status, record = await call(http, box, "PATCH", "/v1/models/newer", {"aliases": []})  # by an alias, to none
    assert (status, record["id"], record["aliases"]) == (200, "m", []), record


async def test_aliases_a_change_drops_are_free_at_once_for_a_registration(start_box, http, encoder_dir) -> None:
    """A registration claims its names in `fbx_names` for minutes: a dropped alias's claim is given back."""
    box = await start_box(default_model=False, model_roots=[encoder_dir.parent])
    body = {"name": "enc", "path": str(encoder_dir), "aliases": ["e1"]}
    assert (await call(http, box, "POST", "/v1/models", body))[0] == 201
    status, record = await call(http, box, "PATCH", "/v1/models/enc", {"aliases": ["e2"]})
    assert (status, record["aliases"]) == (200, ["e2"]), record
    status, record = await call(http, box, "POST", "/v1/models", {**body, "name": "enc-2"})
    assert (status, record["aliases"]) == (201, ["e1"]), record
    status, answer = await call(http, box, "PATCH", "/v1/models/enc-2", {"aliases": ["e1", "e2"]})  # claimed by enc
    assert (status, answer["error"]["code"]) == (409, "model_exists"), answer
    assert box.catalog.get("enc-2").aliases == ("e1",)


async def test_pinned_is_set_and_cleared(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("m", pinned=False)])
    status, record = await call(http, box, "PATCH", "/v1/models/m", {"pinned": True})
    assert (status, record["pinned"]) == (200, True), record
    await wait_for(lambda: box.residency.is_resident("m") and "m" in box.residency.pinned, what="m pinned here")
    status, record = await call(http, box, "PATCH", "/v1/models/m", {"pinned": False})
    assert (status, record["pinned"]) == (200, False), record
    assert "m" not in box.residency.pinned


async def test_what_changes_what_is_loaded_is_refused_by_name(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("m", pinned=False)])
    values = {"name": "n", "path": "/x", "task": "embed", "runtime": "onnx", "dtype": "float16", "options": {},
              "profile": "off", "adapter_of": "base", "concurrent_batches": 2}  # fmt: skip
    assert set(values) == set(NEEDS_REGISTRATION)
    for field, value in values.items():
        status, body = await call(http, box, "PATCH", "/v1/models/m", {field: value, "max_batch_size": 2})
        assert (status, body["error"]["code"]) == (422, "needs_registration"), (field, body)
        assert body["error"]["message"].startswith(f"{field} cannot change in place"), body
        assert "DELETE" in body["error"]["message"] and "POST" in body["error"]["message"], body
    status, body = await call(http, box, "PATCH", "/v1/models/m", {"name": None, "max_batch_size": 2})
    assert (status, body["error"]["code"]) == (422, "needs_registration"), body  # even as null, as api.md says
    status, body = await call(http, box, "PATCH", "/v1/models/m", {"path": "/x", "dtype": "float16"})
    assert body["error"]["message"].startswith("path, dtype cannot change in place: they change what is loaded")
    bad = [
        ({}, 422, "nothing_to_change", "nothing to change"),
        ({"aliases": None}, 422, "nothing_to_change", "nothing to change"),
        ({"bogus": 1}, 422, "invalid_input", "unknown field `bogus`"),
        ([], 422, "invalid_input", "Expected `object`"),
        ({"max_batch_size": 0}, 422, "invalid_input", "$.max_batch_size"),
        ({"max_batch_tokens": 2**64}, 422, "invalid_input", "$.max_batch_tokens"),
        ({"max_batch_tokens": 10**18}, 422, "invalid_input", "<= 4194304 - at `$.max_batch_tokens`"),  # h84: taken
        ({"max_batch_size": 10**6}, 422, "invalid_input", "<= 65536 - at `$.max_batch_size`"),
        ({"max_wait_ms": 5000}, 422, "invalid_input", "$.max_wait_ms"),
        ({"pinned": "yes"}, 422, "invalid_input", "$.pinned"),
    ]
    for body, status, code, words in bad:
        got, answer = await call(http, box, "PATCH", "/v1/models/m", body)
        assert (got, answer["error"]["code"]) == (status, code), (body, answer)
        assert words in answer["error"]["message"], (body, answer)
    async with http.patch(
        url(box, "/v1/models/m"), data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    assert box.catalog.get("m").batching.max_batch_size == box.settings.max_batch_size  # nothing written


async def test_an_unknown_model_is_404(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("m", pinned=False)])
    status, body = await call(http, box, "PATCH", "/v1/models/ghost", {"max_batch_size": 2})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert "available models: m" in body["error"]["message"]


async def test_a_change_racing_a_delete_on_another_box_does_not_bring_the_model_back(start_box) -> None:
    box = await start_box(default_model=False, models=[noop_model("m", pinned=False)])
    spec = box.catalog.get("m")
    models = await box.js.key_value(bus.MODELS_BUCKET)
    await models.delete(spec.slug)  # another box deletes it; this box changes what it still knows of
    update = ModelUpdate(aliases=["fresh"], max_batch_size=2)
    with pytest.raises(NotFound, match="deleted meanwhile"):
        await change_model(spec, update, box.catalog, box.store)
    with pytest.raises(KeyNotFoundError):
        await models.get(spec.slug)
    names = await box.js.key_value(bus.NAMES_BUCKET)
    with pytest.raises(KeyNotFoundError):  # the alias it claimed is given back
        await names.get(bus.name_key("fresh"))


async def test_an_adapter_changes_its_aliases_only_and_a_generator_no_batching(start_box, http) -> None:
    models = [
        noop_model("m", pinned=False),
        ModelEntry(name="m:lora", runtime="noop", adapter_of="m"),
        noop("g", pinned=False, task="generate"),
    ]
    box = await start_box(default_model=False, models=models)
    status, record = await call(http, box, "PATCH", "/v1/models/m:lora", {"aliases": ["lora"]})
    assert (status, record["aliases"], record["adapter_of"]) == (200, ["lora"], "m"), record
    status, body = await call(http, box, "PATCH", "/v1/models/m:lora", {"max_batch_size": 2})
    assert (status, body["error"]["code"]) == (422, "needs_registration"), body
    assert "runs in its base model's batches; change max_batch_size on m" in body["error"]["message"]
    for pinned in (True, False):  # as the pin and unpin routes answer
        status, body = await call(http, box, "PATCH", "/v1/models/m:lora", {"pinned": pinned})
        assert status == 409 and "pin or unpin its base model m" in body["error"]["message"], body
    status, body = await call(http, box, "PATCH", "/v1/models/g", {"max_wait_ms": 2})
    assert (status, body["error"]["code"]) == (422, "needs_registration"), body
    assert "its decode batch is set when it loads" in body["error"]["message"]
    assert (await call(http, box, "PATCH", "/v1/models/g", {"aliases": ["gen"], "pinned": False}))[0] == 200


async def test_a_profiled_models_batching_stays_its_profiles(start_box, http, encoder_dir, tmp_path) -> None:
    """The box applies its profile to the changed entry, as a load does: a profile's batching wins, unless the
    model is registered with `profile: "off"`."""
    hardware = hardware_slug("cpu")
    Profile(
        model="tiny", hardware=hardware, runtime="torch", dtype="float32",
        max_batch_tokens=777, max_batch_size=7, max_wait_ms=0.5, threads=1,
    ).write(tmp_path / "profiles" / "tiny" / f"{hardware}.toml")  # fmt: skip
    entries = [
        ModelEntry(name="tiny", path=encoder_dir, task="embed", pinned=True),
        ModelEntry(name="tiny-untuned", path=encoder_dir, task="embed", pinned=True, profile="off"),
    ]
    box = await start_box(default_model=False, models=entries, profiles_dir=tmp_path / "profiles")
    for name, profiled in (("tiny", 7), ("tiny-untuned", 3)):
        status, record = await call(http, box, "PATCH", f"/v1/models/{name}", {"max_batch_size": 3})
        assert (status, record["batching"]["max_batch_size"]) == (200, 3), record
        # The answer's profile is the changed model's, not the one before (black-box finding: it showed the old).
        assert record["profile"]["max_batch_size"] == profiled, record
    await wait_for(lambda: box.workers["tiny-untuned"].batcher.batching.max_batch_size == 3, what="retuned")
    assert box.workers["tiny"].batcher.batching == Batching(777, 7, 0.5)
    assert (await call(http, box, "GET", "/v1/models/tiny"))[1]["profile"]["max_batch_size"] == 7
    assert (await call(http, box, "GET", "/v1/models/tiny-untuned"))[1]["profile"]["max_batch_size"] == 3


async def test_the_route_is_admin_only_and_in_the_openapi_document(start_box, http) -> None:
    box = await start_box(
        default_model=False, models=[noop_model("m", pinned=False)], admin_keys="admin-secret", api_keys="user"
    )
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 2}))[0] == 401
    user = {"Authorization": "Bearer user"}
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 2}, user))[0] == 403
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 2}, ADMIN))[0] == 200
    _, document = await call(http, box, "GET", "/openapi.json")
    patch = document["paths"]["/v1/models/{name}"]["patch"]
    assert patch["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelUpdate")
    assert set(document["components"]["schemas"]["ModelUpdate"]["properties"]) == {
        "aliases", "pinned", "max_batch_tokens", "max_batch_size", "max_wait_ms"
    }  # fmt: skip


async def test_the_cli_updates_a_model_through_a_box(start_box) -> None:
    """The CLI runs its own event loop, so CliRunner runs in a thread here."""
    box = await start_box(default_model=False, models=[noop("m", aliases=["old"])])

    def update(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli.app, ["models", "update", "m", *args, "--nats", box.nats_url])
        return result.exit_code, result.output

    code, output = await asyncio.to_thread(update, "--alias", "a1", "--alias", "a2", "--max-batch-size", "2")
    assert code == 0, output
    reply = json.loads(output)
    assert (reply["aliases"], reply["batching"]["max_batch_size"]) == (["a1", "a2"], 2), reply
    assert box.catalog.get("m").aliases == ("a1", "a2")
    await wait_for(lambda: box.workers["m"].batcher.batching.max_batch_size == 2, what="retuned through the CLI")
    code, output = await asyncio.to_thread(update, "--no-aliases", "--unpin")
    assert code == 0 and json.loads(output)["aliases"] == [] and json.loads(output)["pinned"] is False, output
    code, output = await asyncio.to_thread(update)
    assert code == 2 and "nothing to change" in output, output
    code, output = await asyncio.to_thread(update, "--alias", "a", "--no-aliases")
    assert code == 2 and "not both" in output, output
    # The schema's bounds (tester h96: the CLI took up to 2**63, and the box then refused 65,537 rows as a 422)
    for option, past in (("--max-wait-ms", "5000"), ("--max-batch-size", "99999999999999999999"),
                         ("--max-batch-tokens", str(MAX_BATCH_TOKENS + 1)),
                         ("--max-batch-size", str(MAX_BATCH_SIZE + 1)), ("--max-batch-size", "0")):  # fmt: skip
        code, output = await asyncio.to_thread(update, option, past)  # bounded as the schema is: a usage error
        assert code == 2 and f"Invalid value for '{option}'" in output and "Traceback" not in output, output


async def test_a_retune_finishing_after_a_newer_one_never_applies_the_older_batching(start_box) -> None:
    """Two changes heard close together retune side by side; the older one's profile lookup finishing last used
    to leave the worker on the older knobs for good (found by review)."""
    box = await start_box(default_model=False, models=[noop("m")])
    older = box.catalog.get("m")
    newer = await box.store.update(older, ModelChange(batching={"max_batch_size": 64}))
    worker = box.workers["m"]
    await wait_for(lambda: worker.batcher.batching.max_batch_size == 64, what="the newer batching taken")
    newer_applied = asyncio.Event()
    profiled = box.workers._profiled

    async def older_lookup_finishes_last(spec):
        if spec.batching != newer.batching:
            await newer_applied.wait()
        return await profiled(spec)

    box.workers._profiled = older_lookup_finishes_last
    late = asyncio.create_task(box.workers.retune(older))
    await box.workers.retune(newer)
    newer_applied.set()
    await late
    assert worker.batcher.batching.max_batch_size == 64 and worker.spec.batching.max_batch_size == 64


async def test_a_change_made_while_the_worker_starts_is_not_undone_by_one_made_while_it_loaded(start_box, http) -> None:
    """A change during the load (max_batch_size 3) is applied once the worker has started; one heard while it
    started (5) retunes it at once. The first used to be applied after, as read before the start."""
    box = await start_box(default_model=False, models=[noop("m", pinned=False)])
    loading, release_load = hold(box.residency, "ensure_loaded")
    starting, release_start = hold(box.workers, "_announce")  # called once the worker has started
    serving = asyncio.create_task(box.workers.serve(box.catalog.get("m")))
    await asyncio.wait_for(loading.wait(), 10)
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 3}))[0] == 200
    release_load.set()
    await asyncio.wait_for(starting.wait(), 10)
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 5}))[0] == 200
    await wait_for(lambda: box.workers["m"].batcher.batching.max_batch_size == 5, what="the change heard meanwhile")
    release_start.set()
    worker = await serving
    assert worker.batcher.batching.max_batch_size == 5 and worker.spec.batching.max_batch_size == 5


async def test_an_adapters_record_shows_its_bases_batching_as_a_patch_of_the_base_left_it(start_box, http) -> None:
    """docs/api.md: an adapter runs in its base's batches, and its record says so (it showed its own entry's copy,
    the box's defaults from a models file: found by review)."""
    models = [noop("m", pinned=False), ModelEntry(name="m:lora", runtime="noop", adapter_of="m")]
    box = await start_box(default_model=False, models=models)
    assert (await call(http, box, "PATCH", "/v1/models/m", {"max_batch_size": 2, "max_wait_ms": 3.0}))[0] == 200
    base = (await call(http, box, "GET", "/v1/models/m"))[1]["batching"]
    assert (base["max_batch_size"], base["max_wait_ms"]) == (2, 3.0), base
    for listed in (
        (await call(http, box, "GET", "/v1/models/m:lora"))[1],
        *(await call(http, box, "GET", "/v1/models"))[1]["data"],
    ):
        assert listed["batching"] == base, listed


@pytest.mark.parametrize(
    ("task", "adapter_of", "said"),
    [
        ("embed", None, "give aliases, pinned, max_batch_tokens, max_batch_size or max_wait_ms"),
        ("generate", None, "give aliases or pinned (a generator's decode batch is set by its options"),
        ("classify", "base", "give aliases (an adapter's pin and batching are its base model's)"),
    ],
)
def test_nothing_to_change_names_what_the_model_takes(task: str, adapter_of: str | None, said: str) -> None:
    """Tester h224: `PATCH {}` on a generator or an adapter listed the batching knobs (and, to an adapter, the pin),
    which each refuses."""
    from pathlib import Path

    from appliance.catalog import ModelSpec
    from appliance.errors import Unprocessable
    from runtimes import RuntimeKind, Task

    spec = ModelSpec(
        "m", "m", Task(task), RuntimeKind.TORCH, Path("/x"), Batching(256, 4, 0.0, 1), adapter_of=adapter_of
    )
    with pytest.raises(Unprocessable, match=r"^nothing to change: ") as refused:
        asyncio.run(change_model(spec, ModelUpdate(), None, None))  # type: ignore[arg-type]
    assert said in refused.value.message and refused.value.code == "nothing_to_change"
