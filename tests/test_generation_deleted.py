"""A generator deleted while it generates: its requests are answered 404 at once and leave the queue.

Handed back (as a drain does for a model that stays in the catalog) they would wait with no consumer
until their deadline, or be generated again by whatever model is registered under the name next.
The queue, the box and the tiny generator are real; a threading.Event in a wrapper of the runtime's
own `_decode` holds the device thread at the first decode step until the model is deleted, so the
requests are mid-generation then, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import shutil
import threading

import orjson

from appliance import bus
from appliance.settings import ModelEntry
from tests.conftest import url, wait_for

MODEL = "tiny-llama"
_BOUND_S = 20.0  # the most the device thread is held waiting for the test


def hold_decoding(runtime) -> tuple[threading.Event, threading.Event]:
    """(entered, release): the first decode step waits for `release` once it has set `entered`."""
    decode, entered, release = runtime._decode, threading.Event(), threading.Event()

    def held_decode():
        entered.set()
        release.wait(_BOUND_S)
        return decode()

    runtime._decode = held_decode
    return entered, release


async def streamed_error(http, box, body: dict) -> tuple[int, dict | None]:
    """The stream's status and its error event, if any (after which it must end with [DONE])."""
    async with http.post(url(box, "/v1/completions"), json=body | {"stream": True}) as response:
        events = [line[6:] async for line in response.content if line.startswith(b"data: ")]
    assert events[-1].strip() == b"[DONE]"
    errors = [orjson.loads(e)["error"] for e in events[:-1] if b'"error"' in e]
    return response.status, errors[0] if errors else None


async def whole(http, box, body: dict) -> tuple[int, dict]:
    async with http.post(url(box, "/v1/completions"), json=body) as response:
        return response.status, await response.json()


async def test_requests_of_a_generator_deleted_mid_generation_are_answered_404_and_leave_the_queue(
    start_box, http, generator_dir
) -> None:
    model = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True)
    box = await start_box(default_model=False, models=[model])
    worker = box.workers[MODEL]
    entered, release = hold_decoding(worker.runtime)
    body = {"model": MODEL, "prompt": "Alice", "max_tokens": 200, "temperature": 0, "timeout": 30}
    streamed = asyncio.create_task(streamed_error(http, box, body))
    await wait_for(entered.is_set, what="the stream to be decoding")
    answered = asyncio.create_task(whole(http, box, body))
    await wait_for(lambda: len(worker._held.streams) == 2, what="the second request to wait for the next step")

    async with http.delete(url(box, f"/v1/models/{MODEL}")) as response:
        assert response.status == 200
    await wait_for(lambda: MODEL not in box.workers, what="the worker to stop")
    release.set()

    async with asyncio.timeout(30):
        (stream_status, stream_error), (status, answer) = await asyncio.gather(streamed, answered)
    assert stream_status == 200  # the stream had begun: its error is an event
    assert stream_error is not None and stream_error["code"] == "model_not_found", stream_error
    assert "was deleted while this request was generating" in stream_error["message"]
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer

    async def queue_empty() -> bool:
        info = await box.js.stream_info(bus.REQUEST_STREAM, subjects_filter=bus.request_subject(bus.model_slug(MODEL)))
        return info.state.messages == 0

    await wait_for(queue_empty, what="nothing of the deleted model left in the queue")
    await wait_for(lambda: not box.residency.is_resident(MODEL), what="the deleted model to be unloaded")


async def test_requests_of_a_deleted_generator_are_not_generated_by_the_model_registered_next_under_its_name(
    start_box, http, generator_dir, tmp_path
) -> None:
    other = shutil.copytree(generator_dir, tmp_path / "other")
    model = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True)
    box = await start_box(default_model=False, models=[model], model_roots=[generator_dir.parent, tmp_path])
    worker = box.workers[MODEL]
    entered, release = hold_decoding(worker.runtime)
    body = {"model": MODEL, "prompt": "Alice", "max_tokens": 200, "temperature": 0, "timeout": 30}
    old = asyncio.create_task(whole(http, box, body))
    await wait_for(entered.is_set, what="the request to be decoding")

    async with http.delete(url(box, f"/v1/models/{MODEL}")) as response:
        assert response.status == 200
    registration = {"name": MODEL, "path": str(other), "task": "generate"}
    async with http.post(url(box, "/v1/models"), json=registration) as response:
        assert response.status == 201, await response.text()
    release.set()

    async with asyncio.timeout(30):
        status, answer = await old
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    status, answer = await whole(http, box, body | {"max_tokens": 4})
    assert status == 200, answer  # the new model's own queue was left alone


async def test_a_generation_waiting_for_a_decode_slot_when_its_adapter_is_deleted_is_answered_404(
    start_box, http, generator_dir, second_generator_adapter_dir
) -> None:
    """One decode slot, held by a generation of the base: a request for the adapter waits to join. Its adapter deleted,
    it is answered 404 at once, where it was generated by the deleted adapter once the slot freed (h62); the base's
    generation, already under way, goes on to its answer."""
    base = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True, options={"max_batch_size": 1})
    adapter = ModelEntry(name=f"{MODEL}:lora", path=second_generator_adapter_dir, adapter_of=MODEL)
    box = await start_box(default_model=False, models=[base, adapter])
    worker = box.workers[MODEL]
    entered, release = hold_decoding(worker.runtime)
    body = {"prompt": "Alice", "max_tokens": 8, "temperature": 0, "timeout": 30}
    generating = asyncio.create_task(whole(http, box, body | {"model": MODEL}))
    await wait_for(entered.is_set, what="the base's generation to hold the one decode slot")
    waiting = asyncio.create_task(whole(http, box, body | {"model": f"{MODEL}:lora"}))
    await wait_for(lambda: len(worker._held.streams) == 2, what="the adapter's request to wait for the slot")
    try:
        async with http.delete(url(box, f"/v1/models/{MODEL}:lora")) as response:
            assert response.status == 200
        async with asyncio.timeout(10):
            status, answer = await waiting
        assert (status, answer["error"]["code"]) == (404, "model_not_found"), answer
        assert answer["error"]["message"] == f"adapter '{MODEL}:lora' was deleted while this request waited for it"
    finally:
        release.set()
    async with asyncio.timeout(30):
        status, answer = await generating
    assert status == 200, answer


async def test_a_generation_waiting_for_a_slot_when_its_adapter_is_registered_anew_runs_the_new_one(
    start_box, http, generator_dir, adapter_dirs, second_generator_adapter_dir
) -> None:
    """Review r60: an adapter registered again on another folder (heard as one change, as after a watch that missed
    the deletion) left a generation waiting for a decode slot to run the old weights. It is handed back and admitted
    again with the new registration."""
    from appliance.configured import spec_from_entry
    from runtimes import Task

    adapter = f"{MODEL}:lora"
    base = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True, options={"max_batch_size": 1})
    old = ModelEntry(name=adapter, path=second_generator_adapter_dir, adapter_of=MODEL)
    roots = [generator_dir.parent, second_generator_adapter_dir.parent, adapter_dirs[Task.GENERATE].parent]
    box = await start_box(default_model=False, models=[base, old], model_roots=roots)
    body = {"prompt": "Alice", "max_tokens": 8, "temperature": 0, "timeout": 30}
    _, before = await whole(http, box, body | {"model": adapter})
    worker = box.workers[MODEL]
    entered, release = hold_decoding(worker.runtime)
    generating = asyncio.create_task(whole(http, box, body | {"model": MODEL}))
    await wait_for(entered.is_set, what="the base's generation to hold the one decode slot")
    waiting = asyncio.create_task(whole(http, box, body | {"model": adapter}))
    await wait_for(lambda: len(worker._held.streams) == 2, what="the adapter's request to wait for the slot")
    try:
        new = spec_from_entry(old.model_copy(update={"path": adapter_dirs[Task.GENERATE]}), box.settings)
        kv = await box.js.key_value(bus.MODELS_BUCKET)
        await kv.put(new.slug, new.to_json())  # the same name on another folder, as one change
        await wait_for(lambda: len(worker._held.streams) == 1, what="the adapter's request handed back")
    finally:
        release.set()
    async with asyncio.timeout(30):
        (status, answer), (base_status, _) = await asyncio.gather(waiting, generating)
    assert status == 200 and base_status == 200, answer
    _, after = await whole(http, box, body | {"model": adapter})
    assert answer["choices"][0]["text"] == after["choices"][0]["text"] != before["choices"][0]["text"]


async def test_a_generation_admitted_as_its_adapter_is_registered_anew_runs_the_new_one(
    start_box, http, generator_dir, adapter_dirs, second_generator_adapter_dir, monkeypatch
) -> None:
    """A generation whose prompt was being rendered when its adapter was registered again on another folder is not in
    the decode table `adapters_retired` hands back from: it ran the old weights (planning item after review r60). It
    takes the new registration once its prompt is ready."""
    from appliance import generation_intake
    from appliance.configured import spec_from_entry
    from runtimes import Task

    adapter = f"{MODEL}:lora"
    base = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True)
    old = ModelEntry(name=adapter, path=second_generator_adapter_dir, adapter_of=MODEL)
    roots = [generator_dir.parent, second_generator_adapter_dir.parent, adapter_dirs[Task.GENERATE].parent]
    box = await start_box(default_model=False, models=[base, old], model_roots=roots)
    body = {"model": adapter, "prompt": "Alice", "max_tokens": 8, "temperature": 0, "timeout": 30}
    _, before = await whole(http, box, body)
    rendering, release = threading.Event(), threading.Event()
    render = generation_intake.prompt_ids

    def held_render(runtime, request):
        rendering.set()
        release.wait(_BOUND_S)
        return render(runtime, request)

    monkeypatch.setattr(generation_intake, "prompt_ids", held_render)
    admitted = asyncio.create_task(whole(http, box, body))
    try:
        await wait_for(rendering.is_set, what="the generation's prompt being rendered")
        new = spec_from_entry(old.model_copy(update={"path": adapter_dirs[Task.GENERATE]}), box.settings)
        kv = await box.js.key_value(bus.MODELS_BUCKET)
        await kv.put(new.slug, new.to_json())  # the same name on another folder, as one change
        await wait_for(lambda: box.catalog.get(adapter).path == new.path, what="the new registration heard")
    finally:
        release.set()
    async with asyncio.timeout(30):
        status, answer = await admitted
    assert status == 200, answer
    monkeypatch.setattr(generation_intake, "prompt_ids", render)
    _, after = await whole(http, box, body)
    assert answer["choices"][0]["text"] == after["choices"][0]["text"] != before["choices"][0]["text"]
