"""Shared fixtures: real nats-server processes on free loopback ports, and boxes started in-process.

Nothing here is a fake: every box talks to a real JetStream. The session-wide `default_box`
serves the packaged all-MiniLM-L6-v2 so the tests that only need "a box" share one model load.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.msg import Msg

from appliance import bus
from appliance.app import Box
from appliance.envelope import RequestMeta
from appliance.natsd import EmbeddedNats, free_port
from appliance.settings import ModelEntry, Settings
from tests.models import (  # noqa: F401 - fixtures, registered by being here
    adapter_dirs,
    classifier_dir,
    cross_encoder_dir,
    encoder_dir,
    generator_dir,
    model_dirs,
    second_generator_adapter_dir,
    token_classifier_dir,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


async def start_nats(store: Path) -> EmbeddedNats:
    server = EmbeddedNats(store_dir=store, port=free_port())
    await server.start()
    return server


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    server = await start_nats(tmp_path / "nats")
    yield server
    await server.stop()


BoxFactory = Callable[..., Awaitable[Box]]


def box_settings(nats_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"nats": nats_url, "port": 0, "host": "127.0.0.1", "device": "cpu"}
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def start_box(nats_server: EmbeddedNats) -> AsyncIterator[BoxFactory]:
    """Start boxes on the test's NATS; all are stopped at the end of the test."""
    boxes: list[Box] = []

    async def start(**overrides: Any) -> Box:
        box = Box(box_settings(nats_server.url, **overrides))
        await box.start()
        boxes.append(box)
        return box

    yield start
    for box in reversed(boxes):
        await box.stop()


def hold_warm_ups(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Workers started from now on wait in their warm-up until the event returned is set."""
    from appliance.batcher import Batcher

    release = asyncio.Event()
    warm_up = Batcher.warm_up

    async def held_warm_up(self: Batcher) -> None:
        await release.wait()
        await warm_up(self)

    monkeypatch.setattr(Batcher, "warm_up", held_warm_up)
    return release


def noop_model(name: str = "noop", *, pinned: bool = True, **options: Any) -> ModelEntry:
    """A model on the no-op runtime: the serving path without model cost (or with a set cost)."""
    return ModelEntry(name=name, runtime="noop", pinned=pinned, options=options)


@pytest.fixture(scope="session")
async def default_box(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Box]:
    server = await start_nats(tmp_path_factory.mktemp("nats-default"))
    box = Box(box_settings(server.url, box_id="default-box"))
    await box.start()
    yield box
    await box.stop()
    await server.stop()


@contextlib.asynccontextmanager
async def box_with_models(
    tmp_path_factory: pytest.TempPathFactory, box_id: str, models: dict[str, Path]
) -> AsyncIterator[tuple[Box, dict[str, dict[str, Any]]]]:
    """One box on a NATS of its own, with `models` (name -> folder) registered over HTTP the way users register
    theirs (any folder under the tests' base temp dir), and the answer each registration got."""
    server = await start_nats(tmp_path_factory.mktemp(f"nats-{box_id}"))
    root = tmp_path_factory.getbasetemp()
    box = Box(box_settings(server.url, box_id=box_id, model_roots=[root], max_wait_ms=5))
    await box.start()
    registered = {}
    try:
        async with aiohttp.ClientSession() as http:
            for name, folder in models.items():
                async with http.post(url(box, "/v1/models"), json={"name": name, "path": str(folder)}) as response:
                    assert response.status == 201, await response.text()
                    registered[name] = await response.json()
        yield box, registered
    finally:
        await box.stop()
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def url(box: Box, path: str) -> str:
    return f"http://127.0.0.1:{box.http_port}{path}"


def awaited_on(reply: str, run: str = "") -> RequestMeta:
    """A request whose gateway awaits its answer on `reply` (`bus.reply_subject`), of that gateway's run `run`: what
    `Fleet.gateway_gone` judges."""
    return RequestMeta(id="r", task="embed", model="m", reply=reply, run=run, deadline_ms=10**13, sent_ms=10**12)


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """Poll a condition (plain or async) until it holds, bounded; no bare sleeps as synchronisation."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        held = condition()
        if await held if inspect.isawaitable(held) else held:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def freeze(nats_server: EmbeddedNats) -> None:
    """SIGSTOP the server and wait until every thread of it is stopped: the signal returns at once, and its threads
    stop as each next runs (0.5-4 ms here idle); a request sent in between was answered 200 where a frozen server
    was meant (a clean-clone CI run). Bounded; SIGCONT it after, as ever."""
    pid = nats_server.process.pid
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        return bool(states) and all(state in ("T", "t") for state in states)

    await wait_for(stopped, timeout_s=5.0, what="every thread of the nats-server stopped")


async def in_progress_acks(nats_url: str) -> tuple[nats.NATS, list[Msg]]:
    """A connection that hears the in-progress acks boxes send to JetStream (on its ack subjects, as any subscriber
    can), and the list they are put in: how a test sees that a request is kept alive. Close the connection."""
    nc = await nats.connect(nats_url)
    heard: list[Msg] = []

    async def on_ack(msg: Msg) -> None:
        if msg.data == b"+WPI":
            heard.append(msg)

    await nc.subscribe("$JS.ACK.>", cb=on_ack)
    return nc, heard


async def deliveries(box: Box, model: str) -> int:
    """How many messages the model's request consumer has delivered, redeliveries counted."""
    info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(bus.model_slug(model)))
    return info.delivered.consumer_seq


def hold(owner: object, method: str, *, after: bool = False) -> tuple[asyncio.Event, asyncio.Event]:
    """`owner.method` (an async method; the real one still runs) held at its first call, before the call or `after`
    it, until `go_on` is set; `reached` says it is held. How a race test puts another actor at the right moment."""
    real = getattr(owner, method)
    reached, go_on = asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        first = not reached.is_set()
        if first and not after:
            reached.set()
            await go_on.wait()
        done = await real(*args, **kwargs)
        if first and after:
            reached.set()
            await go_on.wait()
        return done

    setattr(owner, method, held)
    return reached, go_on


def hold_on_device(runtime: Any) -> tuple[threading.Event, threading.Event]:
    """Wrap a runtime's `run` so each batch, once on the device thread, sets the first event and waits (30 s at
    most) for the test to set the second: a batch "on the device" for as long as a test needs it there."""
    run, on_device, let_go = runtime.run, threading.Event(), threading.Event()

    def held_run(batch, adapter=None):
        on_device.set()
        assert let_go.wait(30), "the test did not let the batch go"
        return run(batch, adapter=adapter)

    runtime.run = held_run
    return on_device, let_go
