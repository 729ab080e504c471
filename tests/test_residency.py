"""The residency table's eviction rules, without a box: no-op models (which claim a set size) on a
real executor; the hook that drains a model's worker is played by an event the test releases. Then
tests run a box, for a model deleted while its load is in flight there; the last ones load a real
model whose measured bytes are far above its estimate."""

from __future__ import annotations

import asyncio
import math
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from appliance.catalog import ModelSpec
from appliance.configured import spec_from_entry
from appliance.errors import InsufficientMemory
from appliance.eviction import DEMAND_HALF_LIFE_S, Demand
from appliance.metrics import Metrics
from appliance.model_bytes import estimate_bytes
from appliance.residency import Residency
from appliance.settings import ModelEntry, Settings
from runtimes import Runtime
from tests.conftest import noop_model, url, wait_for
from tests.models import save_long_context_encoder


def noop_specs(**sizes: int) -> dict[str, ModelSpec]:
    return {name: spec_from_entry(noop_model(name, pinned=False, bytes=n), Settings()) for name, n in sizes.items()}


def resident_names(residency: Residency) -> set[str]:
    return {r.spec.name for r in residency.residents()}


SPECS = noop_specs(a=1000, b=1000)


class Drains:
    """Each model's worker drain: it starts, then waits (for its batch in flight) until the test ends it."""

    def __init__(self) -> None:
        self.started: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.done: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def __call__(self, name: str) -> None:
        self.started[name].set()
        await self.done[name].wait()


@pytest.fixture
async def drains() -> Drains:
    return Drains()


@pytest.fixture
async def residency(drains: Drains):
    with ThreadPoolExecutor(1) as executor:
        yield Residency("cpu", None, 10_000, Metrics(), executor, before_evict=drains)


async def started_eviction(residency: Residency, drains: Drains, name: str) -> asyncio.Task[bool]:
    eviction = asyncio.create_task(residency.evict(name))
    async with asyncio.timeout(10):
        await drains.started[name].wait()
    return eviction


async def test_a_model_being_evicted_is_loaded_afresh_not_handed_out(residency: Residency, drains: Drains) -> None:
    """Handed out, its runtime would serve a new worker and then be closed under it."""
    old = await residency.ensure_loaded(SPECS["a"])
    eviction = await started_eviction(residency, drains, "a")
    asking = asyncio.create_task(residency.ensure_loaded(SPECS["a"]))
    await asyncio.sleep(0.05)
    assert not asking.done()  # it waits for the eviction
    drains.done["a"].set()
    assert await eviction
    new = await asking
    assert new is not old and residency.get("a") is not None and residency.get("a").runtime is new


async def test_out_of_memory_does_not_evict_a_model_whose_eviction_waits_for_it(
    residency: Residency, drains: Drains
) -> None:
    """b's eviction waits for b's batch; that batch running out of memory must not evict a for it (a's
    eviction would wait for a's batch, which waits for b's eviction: neither would ever end)."""
    await residency.ensure_loaded(SPECS["a"])
    await residency.ensure_loaded(SPECS["b"])
    eviction = await started_eviction(residency, drains, "b")  # a's batch ran out of memory, say
    assert not await residency.evict_for_oom(keep="b")  # b's own batch runs out too: it fails alone
    assert residency.get("a") is not None and not drains.started["a"].is_set()
    assert not await residency.evict_for_oom(keep="a")  # b is on its way out already: not evicted twice
    drains.done["b"].set()
    assert await eviction and residency.get("b") is None


async def test_an_evict_asked_during_an_eviction_waits_for_it_and_says_the_model_is_gone(
    residency: Residency, drains: Drains
) -> None:
    """Not False (a 404 "not resident" for a model still resident while its worker drains)."""
    await residency.ensure_loaded(SPECS["a"])
    first = await started_eviction(residency, drains, "a")
    second = asyncio.create_task(residency.evict("a"))
    await asyncio.sleep(0)
    assert not second.done()
    drains.done["a"].set()
    assert await first and await second and residency.get("a") is None


async def test_a_load_waits_for_an_eviction_under_way_rather_than_evict_one_more_model(drains: Drains) -> None:
    """a is being evicted (asked by an operator) when c needs room: a's leaving is room enough, so b stays."""
    specs = noop_specs(a=4000, b=4000, c=4000)
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 10_000, Metrics(), executor, before_evict=drains)
        await residency.ensure_loaded(specs["a"])
        await residency.ensure_loaded(specs["b"])
        eviction = await started_eviction(residency, drains, "a")
        loading = asyncio.create_task(residency.ensure_loaded(specs["c"]))
        await asyncio.sleep(0.05)
        assert not loading.done()  # it waits for a to be gone
        assert not drains.started["b"].is_set()
        drains.done["a"].set()
        async with asyncio.timeout(10):
            assert await eviction
            await loading
        assert resident_names(residency) == {"b", "c"}
        assert not drains.started["b"].is_set()


@contextmanager
def loads_held(box) -> Iterator[None]:
    """Keep the box's load threads (its CPU executor) busy: a load asked meanwhile stays in flight."""
    release = threading.Event()
    executor = box._cpu_executor
    blockers = [executor.submit(release.wait) for _ in range(executor._max_workers)]
    try:
        yield
    finally:
        release.set()
        for blocker in blockers:
            blocker.result()


async def call(http, box, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with http.request(method, url(box, path), json=body) as response:
        return response.status, await response.json()


def model_loads(box, name: str) -> float:
    return box.metrics.registry.get_sample_value("fbx_model_loads_total", {"model": name}) or 0


async def test_a_model_deleted_while_it_loads_is_unloaded_once_loaded(start_box, http, cross_encoder_dir) -> None:
    """The catalog's watch found nothing resident to evict, and the load then finished: resident for ever,
    with no API call able to unload it (each answered 404)."""
    box = await start_box(default_model=False, model_roots=[cross_encoder_dir.parent.parent])
    with loads_held(box):
        registration = {"name": "rr", "path": str(cross_encoder_dir), "pinned": True}
        assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201
        assert (await call(http, box, "DELETE", "/v1/models/rr"))[0] == 200
    await wait_for(lambda: model_loads(box, "rr") == 1, what="the load in flight to finish")
    await wait_for(lambda: not box.residency.is_resident("rr"), what="the deleted model to be unloaded")
    assert "rr" not in box.residency.pinned and "rr" not in box.workers
    assert box.metrics.registry.get_sample_value("fbx_resident_model_bytes", {"model": "rr"}) is None


async def test_a_name_registered_again_while_its_old_folder_loads_serves_the_new_folder(
    start_box, http, cross_encoder_dir, tmp_path_factory
) -> None:
    """The new registration's load joined the old one in flight and served the old folder's weights."""
    from transformers import BertForSequenceClassification

    from benchmarks._models import copy_bert_tokenizer
    from tests.models import _bert_config

    torch.manual_seed(5)
    other = tmp_path_factory.mktemp("cross-encoder-2")
    BertForSequenceClassification(_bert_config(num_labels=1)).save_pretrained(other)
    copy_bert_tokenizer(other)
    box = await start_box(default_model=False, model_roots=[Path(cross_encoder_dir).parent.parent])
    rerank = {"query": "capital of France", "documents": ["Paris is the capital.", "Berlin is in Germany."]}
    assert (await call(http, box, "POST", "/v1/models", {"name": "ref", "path": str(other)}))[0] == 201
    _, expected = await call(http, box, "POST", "/v1/rerank", {"model": "ref", **rerank})

    with loads_held(box):
        for folder in (cross_encoder_dir, other):
            registration = {"name": "rr", "path": str(folder), "pinned": True}
            assert (await call(http, box, "POST", "/v1/models", registration))[0] == 201
            if folder == cross_encoder_dir:
                assert (await call(http, box, "DELETE", "/v1/models/rr"))[0] == 200
    await wait_for(lambda: "rr" in box.workers, what="rr to be served")
    assert box.residency.get("rr").spec.path == other
    status, answer = await call(http, box, "POST", "/v1/rerank", {"model": "rr", **rerank})
    assert status == 200 and answer["results"] == expected["results"], (answer, expected)


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_long_context_encoder(tmp_path_factory.mktemp("long-context"))


def loaded_runtimes(residency: Residency) -> list[Runtime]:
    """Every runtime `residency` loads from now on, resident or not (the real load runs; this only keeps a hand)."""
    loaded: list[Runtime] = []
    real = residency._load_runtime

    async def keeping(spec):
        loaded.append(await real(spec))
        return loaded[-1]

    residency._load_runtime = keeping
    return loaded


async def test_a_model_measured_over_the_budget_is_unloaded_and_refused(long_context_dir: Path) -> None:
    """Its estimate (its weight file) fits the 6 MB budget, its load measures 8 MB: it stayed resident over the
    budget (a config.json that builds 150 layers on 6 layers' weights sat at 1,085 MiB in a 600 MiB budget). It is
    unloaded and refused with the estimate's 507; the next try is refused at once, without loading it again."""
    spec = spec_from_entry(ModelEntry(name="long", path=str(long_context_dir)), Settings())
    assert estimate_bytes(spec) < 6_000_000
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 6_000_000, Metrics(), executor)
        loaded = loaded_runtimes(residency)
        with pytest.raises(InsufficientMemory) as refused:
            await residency.ensure_loaded(spec)
        measured = loaded[0].info.nbytes
        assert measured > 6_000_000 and refused.value.need_bytes == measured
        assert refused.value.message == (
            f"model long measured {measured / 2**20:.0f} MiB loaded (weights and warm-up activations); this box's "
            "budget is 6 MiB with 0 bytes pinned"
        )
        assert not residency.is_resident("long") and residency.used_bytes == 0
        assert not hasattr(loaded[0].backend, "model")  # closed: its weights released
        assert residency.load_error("long") == refused.value.message
        with pytest.raises(InsufficientMemory, match="needs about 8 MiB"):
            await residency.ensure_loaded(spec)
        with pytest.raises(InsufficientMemory):
            await residency.check_fits(spec)  # a registration again, or placement asking whether to try
        assert len(loaded) == 1


@pytest.mark.parametrize("pinned", [False, True])
async def test_a_model_measured_over_its_estimate_evicts_for_its_measured_bytes_or_is_refused_beside_pinned_ones(
    long_context_dir: Path, pinned: bool
) -> None:
    """A 5 MB model resident in a 12 MB budget: the newcomer's estimate fits beside it, its measured bytes do not.
    Unpinned, the resident model is evicted for them; pinned, it cannot be, and the newcomer is refused."""
    spec = spec_from_entry(ModelEntry(name="long", path=str(long_context_dir)), Settings())
    other = spec_from_entry(noop_model("other", pinned=pinned, bytes=5_000_000), Settings())
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 12_000_000, Metrics(), executor)
        if pinned:
            residency.pinned.add("other")
        await residency.ensure_loaded(other)
        if pinned:
            with pytest.raises(InsufficientMemory, match="this box's budget is 11 MiB with 5 MiB pinned"):
                await residency.ensure_loaded(spec)
            assert resident_names(residency) == {"other"}
        else:
            await residency.ensure_loaded(spec)
            assert resident_names(residency) == {"long"}
        assert residency.used_bytes <= residency.budget_bytes


def test_a_models_estimate_counts_the_weights_its_load_reads_not_every_weight_file_in_its_folder(
    encoder_dir: Path, tmp_path: Path
) -> None:
    """Regression tester: hub repositories ship safetensors, a .bin and an onnx/ folder side by side; all were
    counted, and a 26 MiB model was refused 507 as 41 MiB (62 MiB with onnx/) in a 40 MB budget."""
    import shutil

    plain = spec_from_entry(ModelEntry(name="plain", path=str(encoder_dir)), Settings())
    folder = shutil.copytree(encoder_dir, tmp_path / "everything")
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(weights)  # the same weights, the format transformers skips
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(weights)
    everything = spec_from_entry(ModelEntry(name="everything", path=str(folder)), Settings())
    assert estimate_bytes(everything) == estimate_bytes(plain) > len(weights)
    shipped = ModelEntry(name="graph", path=str(folder), runtime="onnx", options={"onnx_file": "onnx/model.onnx"})
    assert estimate_bytes(spec_from_entry(shipped, Settings())) == estimate_bytes(plain)  # the graph alone
    (folder / "onnx" / "model.onnx_data").write_bytes(weights)  # its weights as external data: read too
    assert estimate_bytes(spec_from_entry(shipped, Settings())) == 2 * estimate_bytes(plain)
    (folder / "consolidated.safetensors").write_bytes(weights)  # beside the index's shards (review finding)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model.safetensors"}}')
    assert estimate_bytes(everything) == estimate_bytes(plain)


async def test_an_idle_model_is_evicted_before_one_with_requests_in_hand() -> None:
    """Regression tester: a generator asked once, still generating a long answer, was "least recently used" beside
    a model asked since, so a third model's load evicted it, waiting out its answer (a 504 at 3 s). A model with
    requests in hand (the box's `in_use`) goes after every idle one, whatever their last use."""
    specs = noop_specs(a=1000, b=1000, c=1000)
    busy = {"a"}
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 2_500, Metrics(), executor, in_use=lambda name: name in busy)
        for name in "ab":  # a first: the least recently used
            await residency.ensure_loaded(specs[name])
        await residency.ensure_loaded(specs["c"])
        assert resident_names(residency) == {"a", "c"}
        busy.clear()
        await residency.ensure_loaded(specs["b"])
        assert resident_names(residency) == {"b", "c"}  # idle again: least recently used goes
        await residency.close()


async def test_a_model_just_loaded_for_requests_is_not_evicted_before_it_has_answered() -> None:
    """Tester h95: with more models asked for than the budget holds, the one just loaded had not answered yet, so it
    was the least recently used, and the next load evicted it before its worker pulled: 212 of 234 loads were lost
    so, and 120 of 155 requests were 504s. A model with requests in hand keeps its place for its turn; a model
    whose turn is over (its first answer `min_serve_s` ago) goes instead, used since or not."""
    specs = noop_specs(a=1000, b=1000, c=1000)
    with ThreadPoolExecutor(1) as executor:
        residency = Residency(
            "cpu", None, 2_500, Metrics(), executor, in_use=lambda name: True, min_serve_s=0, first_answer_s=60
        )
        await residency.ensure_loaded(specs["a"])
        await residency.ensure_loaded(specs["b"])  # loaded after a: b, not yet answered, looks more recently used
        residency.touch("a")  # a answered after b loaded; its turn (0 s past its first answer) is over
        await residency.ensure_loaded(specs["c"])
        assert resident_names(residency) == {"b", "c"}  # the one still to answer stayed
        await residency.close()


async def test_a_load_waits_for_a_turn_to_end_rather_than_evict_a_model_in_its_turn() -> None:
    """Every other model is in its turn (answered lately, requests in hand): the newcomer waits until one goes
    idle or its turn ends, and only then evicts it."""
    specs = noop_specs(a=1000, b=1000, c=1000)
    busy = {"a", "b"}
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 2_500, Metrics(), executor, in_use=lambda name: name in busy, min_serve_s=60)
        for name in "ab":
            await residency.ensure_loaded(specs[name])
            residency.touch(name)
        loading = asyncio.create_task(residency.ensure_loaded(specs["c"]))
        await asyncio.sleep(0.3)
        assert not loading.done() and resident_names(residency) == {"a", "b"}
        busy.discard("a")  # a's requests are answered: no longer in its turn
        await asyncio.wait_for(loading, 10)
        assert resident_names(residency) == {"b", "c"}
        await residency.close()


def as_if_unused_for(residency: Residency, name: str, seconds: float) -> None:
    """Move a model's last use and its demand's clock back, as if `seconds` had passed with nobody asking for it."""
    resident = residency.get(name)
    demand = residency.demand(name)
    assert resident is not None and demand is not None
    resident.last_used -= seconds
    demand.at -= seconds


async def test_the_model_asked_for_least_per_byte_it_holds_goes_first_not_the_least_recently_used() -> None:
    """A model's demand is the requests it answered; eviction takes first the one whose bytes will wait longest for
    their next request, not the least recently used (benchmarks/packing.py)."""
    specs = noop_specs(hot=1000, cold=1000, big=3000, new=1000)
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 2_500, Metrics(), executor)
        for name in ("hot", "cold"):
            await residency.ensure_loaded(specs[name])
        residency.touch("hot", answered=5)
        residency.touch("cold", answered=1)  # the most recently used, asked for least
        await residency.ensure_loaded(specs["new"])
        assert resident_names(residency) == {"hot", "new"}
        await residency.close()

        residency = Residency("cpu", None, 4_500, Metrics(), executor)
        for name in ("hot", "big"):
            await residency.ensure_loaded(specs[name])
        residency.touch("hot", answered=2)
        residency.touch("big", answered=4)  # asked for more, and lately, but less per byte it holds: 4/3000 < 2/1000
        await residency.ensure_loaded(specs["cold"])
        await residency.ensure_loaded(specs["new"])
        assert resident_names(residency) == {"hot", "cold", "new"}
        await residency.close()


def test_a_demand_halves_every_half_life_and_says_the_gap_of_a_steady_rate() -> None:
    demand = Demand()
    demand.add(4, now=100.0)
    assert demand.count_at(100.0 + DEMAND_HALF_LIFE_S) == pytest.approx(2.0)
    steady = Demand()
    for second in range(600):  # one request a second for ten half-lives
        steady.add(1, now=float(second))
    assert steady.gap_s(599.0) == pytest.approx(1.0, rel=0.02)
    assert Demand().gap_s(0.0) == math.inf


async def test_a_models_demand_outlasts_its_eviction() -> None:
    """Tester h98: a model's count began afresh at each load, so the most asked model, evicted under pressure, came
    back as a newcomer and went as often as with the least recently used first."""
    specs = noop_specs(hot=1000, cold=1000, new=1000)
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 2_500, Metrics(), executor)
        await residency.ensure_loaded(specs["hot"])
        residency.touch("hot", answered=20)
        assert await residency.evict("hot")
        await residency.ensure_loaded(specs["cold"])
        residency.touch("cold", answered=2)
        await residency.ensure_loaded(specs["hot"])  # back, used since cold was
        await residency.ensure_loaded(specs["new"])
        assert resident_names(residency) == {"hot", "new"}
        residency.forget_load_error("hot", None)  # deleted: its demand goes with it
        assert residency.demand("hot") is None
        await residency.close()


@pytest.mark.parametrize(
    ("answered_then", "unused_s", "answered_now"),
    [(6000, 20, 100), (40, 180, 0)],
    ids=["asked-for-now", "loaded-by-hand"],
)
async def test_a_model_unused_for_long_goes_before_one_used_since_however_often_it_was_asked_before(
    answered_then: int, unused_s: float, answered_now: int
) -> None:
    """Tester h98: a model asked for 6,000 times and then not at all outstayed one asked for a hundred times in the
    last 20 s, its count being halved only once a minute; and a model loaded through `/load`, never asked for, went
    first, even for a model last asked for three minutes before (never asked for, it counts as asked for once, at its
    load)."""
    specs = noop_specs(old=1000, now=1000, new=1000)
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 2_500, Metrics(), executor)
        await residency.ensure_loaded(specs["old"])
        residency.touch("old", answered=answered_then)
        as_if_unused_for(residency, "old", unused_s)
        await residency.ensure_loaded(specs["now"])
        if answered_now:
            residency.touch("now", answered=answered_now)
        await residency.ensure_loaded(specs["new"])
        assert resident_names(residency) == {"now", "new"}
        await residency.close()


async def test_a_load_waits_for_loads_in_flight_rather_than_evict_for_room_they_hold() -> None:
    """Tester h98: when the loads in flight held the room, a load evicted every unpinned model and went ahead over
    the budget all the same: a small generator answering most requests was evicted 20 times so beside a pinned model.
    Evicting could not make room: the load waits for the loads in flight to land, then evicts by the usual order."""
    specs = noop_specs(small=200, big=1500, next=1000)
    pinned = spec_from_entry(noop_model("pinned", pinned=True, bytes=1000), Settings())
    release = threading.Event()
    with ThreadPoolExecutor(2) as executor:
        residency = Residency("cpu", None, 3_000, Metrics(), executor)
        residency.pinned.add("pinned")
        await residency.ensure_loaded(pinned)
        await residency.ensure_loaded(specs["small"])
        residency.touch("small", answered=50)
        load_runtime = residency._load_runtime

        async def slow_for_big(spec: ModelSpec) -> Runtime:
            if spec.name == "big":
                await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
            return await load_runtime(spec)

        residency._load_runtime = slow_for_big  # type: ignore[method-assign]
        big = asyncio.create_task(residency.ensure_loaded(specs["big"]))
        await wait_for(lambda: residency.is_loading("big") and residency.used_bytes >= 2_700)
        following = asyncio.create_task(residency.ensure_loaded(specs["next"]))
        await asyncio.sleep(0.5)
        assert not following.done() and resident_names(residency) == {"pinned", "small"}  # not evicted for nothing
        release.set()
        await asyncio.wait_for(asyncio.gather(big, following), 20)
        # big alone makes room: small, asked for, is not evicted as well (the fewest victims that do)
        assert resident_names(residency) == {"pinned", "small", "next"}
        assert residency.used_bytes <= residency.budget_bytes
        await residency.close()


async def test_a_stopping_box_collects_its_models_memory_once_not_once_a_model(
    encoder_dir: Path, cross_encoder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tester h88: an idle box with 30 resident models took 10 s to stop (its bound is 12 s): each model's unload
    ran a full garbage collection, 0.3-0.7 s apiece. Closed together, they are collected once; an eviction alone
    still collects at once (its memory is what the next load needs)."""
    import gc

    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    with ThreadPoolExecutor(1) as executor:
        residency = Residency("cpu", None, 10**10, Metrics(), executor)
        folders = {"e1": (encoder_dir, "embed"), "e2": (encoder_dir, "embed"), "r": (cross_encoder_dir, "score")}
        for name, (folder, task) in folders.items():
            entry = ModelEntry(name=name, path=folder, task=task, runtime="torch")
            await residency.ensure_loaded(spec_from_entry(entry, Settings()))
        assert await residency.evict("e1")
        assert len(collections) == 1
        await residency.close()
        assert len(collections) == 2 and not residency.residents()
