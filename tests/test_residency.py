"""The residency table's eviction rules, without a box: no-op models (which claim a set size) on a
real executor; the hook that drains a model's worker is played by an event the test releases."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from appliance.configured import spec_from_entry
from appliance.metrics import Metrics
from appliance.residency import Residency
from appliance.settings import Settings
from tests.conftest import noop_model

SPECS = {name: spec_from_entry(noop_model(name, pinned=False, bytes=1000), Settings()) for name in ("a", "b")}


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
    specs = {name: spec_from_entry(noop_model(name, pinned=False, bytes=4000), Settings()) for name in "abc"}
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
        assert {r.spec.name for r in residency.residents()} == {"b", "c"}
        assert not drains.started["b"].is_set()
