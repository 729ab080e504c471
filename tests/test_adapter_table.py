"""The adapter table of one base (appliance/adapters.py) on a real runtime: retirements that come while a
generation runs with the adapter, while it loads or while it is being unloaded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from appliance.adapters import BaseAdapters
from appliance.catalog import Batching, ModelSpec
from appliance.metrics import Metrics
from runtimes import ModelSource, RuntimeKind, Task, load_runtime
from runtimes.generate import GenerateRuntime, SamplingParams
from tests.conftest import wait_for


def adapter_spec(name: str, folder: Path, task: Task) -> ModelSpec:
    return ModelSpec(
        name=name, slug=name, task=task, runtime=RuntimeKind.TORCH, path=folder,
        batching=Batching(512, 8, 1), adapter_of="base",
    )  # fmt: skip


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as threads:  # one thread, as a box's: a job queued behind a blocker waits for it
        yield threads


@pytest.fixture
def generator(model_dirs: dict[Task, Path]) -> Iterator[GenerateRuntime]:
    runtime = load_runtime(ModelSource(model_dirs[Task.GENERATE], Task.GENERATE))
    yield runtime
    runtime.close()


def generate_with(runtime: GenerateRuntime, key: str) -> None:
    runtime.add("r", np.array([5, 6, 7]), SamplingParams(max_tokens=3, temperature=0), adapter=key)


def finish(runtime: GenerateRuntime) -> None:
    while runtime.has_work:
        runtime.step()


def blocked(executor: ThreadPoolExecutor) -> threading.Event:
    """Hold the executor's one thread until the event is set: what is queued behind waits for it."""
    go_on = threading.Event()
    executor.submit(go_on.wait, 20)
    return go_on


async def test_a_deleted_adapter_a_generation_runs_with_is_unloaded_when_the_generation_ends(
    generator: GenerateRuntime, adapter_dirs: dict[Task, Path], executor: ThreadPoolExecutor
) -> None:
    """The runtime refuses the unload while the generation runs; nothing swept again once it ended (the
    generation's hold was released when the runtime took the request), so the adapter stayed loaded."""
    table = BaseAdapters("base", generator, 8, executor, Metrics())
    entry = await table.acquire(adapter_spec("a", adapter_dirs[Task.GENERATE], Task.GENERATE), hold=True)
    generate_with(generator, entry.key)
    table.release(entry)
    table.retire("a")
    await wait_for(lambda: entry.key in generator.adapters and not table._sweeps, what="the refused unload")
    assert table.names() == []
    finish(generator)
    await wait_for(lambda: generator.adapters == (), what="the deleted adapter to be unloaded")
    table.close()


async def test_an_adapter_deleted_while_it_loads_is_unloaded_once_its_request_is_done(
    generator: GenerateRuntime, adapter_dirs: dict[Task, Path], executor: ThreadPoolExecutor
) -> None:
    """retire() marked only the loaded entries: one loading then was added unmarked, and stayed loaded."""
    table = BaseAdapters("base", generator, 8, executor, Metrics())
    go_on = blocked(executor)
    acquiring = asyncio.create_task(table.acquire(adapter_spec("a", adapter_dirs[Task.GENERATE], Task.GENERATE), True))
    await asyncio.sleep(0)  # the acquire runs up to its load, queued behind the blocker
    table.retire("a")
    go_on.set()
    entry = await acquiring
    assert entry.key in generator.adapters  # the request that asked before the deletion runs with it
    table.release(entry)
    await wait_for(lambda: generator.adapters == (), what="the deleted adapter to be unloaded")
    assert table.names() == []
    table.close()


async def test_an_adapter_deleted_while_its_refused_unload_runs_is_retired(
    generator: GenerateRuntime,
    adapter_dirs: dict[Task, Path],
    second_generator_adapter_dir: Path,
    executor: ThreadPoolExecutor,
) -> None:
    """An unload takes the entry out of the table while it waits; the runtime refused it (a generation runs with
    the adapter) and put it back unmarked: the deleted adapter stayed servable and loaded."""
    table = BaseAdapters("base", generator, 1, executor, Metrics())
    first = await table.acquire(adapter_spec("a", adapter_dirs[Task.GENERATE], Task.GENERATE), hold=False)
    generate_with(generator, first.key)
    go_on = blocked(executor)
    other = adapter_spec("b", second_generator_adapter_dir, Task.GENERATE)
    loading = asyncio.create_task(table.acquire(other, hold=False))  # past the cap: unloads "a" first
    await asyncio.sleep(0)  # the unload of "a" is queued behind the blocker
    table.retire("a")
    go_on.set()
    await loading
    assert table.names() == ["b"]
    finish(generator)
    await wait_for(lambda: first.key not in generator.adapters, what="the deleted adapter to be unloaded")
    table.close()


async def test_each_load_has_a_runtime_key_no_adapter_name_can_take(
    model_dirs: dict[Task, Path], classifier_dir: Path, tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    """A registration loaded beside a held older one ran under `name#2`, which names may contain: with an adapter
    really named so loaded, the new registration was served that adapter's weights."""
    from tests.models import make_adapter

    runtime = load_runtime(ModelSource(classifier_dir, Task.CLASSIFY))
    batch = runtime.tokenize(["a fine film, all in all"])
    folders = [make_adapter(Task.CLASSIFY, classifier_dir, tmp_path / str(seed), seed=seed) for seed in (51, 52, 53)]
    table = BaseAdapters("base", runtime, 8, executor, Metrics())
    named_like_it = await table.acquire(adapter_spec("base:a#2", folders[0], Task.CLASSIFY), hold=True)
    old = await table.acquire(adapter_spec("base:a", folders[1], Task.CLASSIFY), hold=True)
    table.retire("base:a", keep=adapter_spec("base:a", folders[2], Task.CLASSIFY))  # registered again elsewhere
    new = await table.acquire(adapter_spec("base:a", folders[2], Task.CLASSIFY), hold=True)
    assert len({named_like_it.key, old.key, new.key}) == 3
    runtime.load_adapter("reference", folders[2])
    np.testing.assert_array_equal(runtime.run(batch, adapter=new.key), runtime.run(batch, adapter="reference"))
    table.close()
    runtime.close()


@pytest.mark.parametrize("ahead", ["the same adapter", "another adapter"])
async def test_an_adapter_deleted_while_a_request_waits_for_another_load_is_not_loaded_for_good(
    generator: GenerateRuntime,
    adapter_dirs: dict[Task, Path],
    second_generator_adapter_dir: Path,
    ahead: str,
    executor: ThreadPoolExecutor,
) -> None:
    """A request waiting for the table's lock behind a load (of its own adapter, or another) while its adapter
    was deleted found no live entry once it had the lock, and loaded the deleted adapter again, unmarked: it
    stayed loaded, and listed, until an LRU eviction."""
    table = BaseAdapters("base", generator, 8, executor, Metrics())
    wanted = adapter_spec("a", adapter_dirs[Task.GENERATE], Task.GENERATE)
    first = wanted if ahead == "the same adapter" else adapter_spec("b", second_generator_adapter_dir, Task.GENERATE)
    go_on = blocked(executor)
    loading = asyncio.create_task(table.acquire(first, True))
    await asyncio.sleep(0)  # the first load is queued behind the blocker, holding the table's lock
    waiting = asyncio.create_task(table.acquire(wanted, True))
    await asyncio.sleep(0)  # the second request waits for the lock
    table.retire("a")
    go_on.set()
    for entry in (await loading, await waiting):
        table.release(entry)
    await wait_for(lambda: "a" not in table.names(), what="the deleted adapter to leave the table")
    await wait_for(lambda: len(generator.adapters) == (0 if ahead == "the same adapter" else 1), what="unloads")
    table.close()


async def test_an_adapter_in_the_way_of_another_is_unloaded_when_idle_and_a_503_while_in_use(
    generator: GenerateRuntime, model_dirs: dict[Task, Path], executor: ThreadPoolExecutor, tmp_path: Path
) -> None:
    """Two valid adapters peft cannot hold together (a copy of embed_tokens, a LoRA on it): the second was a 422
    `bad_adapter` ("does not fit this base"), whichever loaded second (h62). Now the one in the way is unloaded
    when no request holds it, and a request for the other waits for nothing; while one holds it, a 503 to retry."""
    from appliance.errors import ServiceUnavailable
    from tests.models import make_adapter

    base_dir = model_dirs[Task.GENERATE]
    copy = make_adapter(Task.GENERATE, base_dir, tmp_path / "copy", seed=61, modules_to_save=["embed_tokens"])
    lora = make_adapter(Task.GENERATE, base_dir, tmp_path / "lora", seed=62, target_modules=["q_proj", "embed_tokens"])
    table = BaseAdapters("base", generator, 8, executor, Metrics())
    held = await table.acquire(adapter_spec("copy", copy, Task.GENERATE), hold=True)
    with pytest.raises(ServiceUnavailable, match="cannot be loaded on base beside copy, which requests are using"):
        await table.acquire(adapter_spec("lora", lora, Task.GENERATE), hold=False)
    table.release(held)
    entry = await table.acquire(adapter_spec("lora", lora, Task.GENERATE), hold=False)
    assert table.names() == ["lora"] and generator.adapters == (entry.key,)
    await table.acquire(adapter_spec("copy", copy, Task.GENERATE), hold=False)  # and back: it is the one in the way
    assert table.names() == ["copy"]
    table.close()
