"""The decode loop of one generative model: one stepping task drives `runtime.step()` on the device thread.

The rule: the task steps while any request is active and sleeps until one joins (`wake`); a request joins at the
next step boundary, and each step's text goes to the request's gateway at once as a numbered chunk
(`generation_replies.py`). Requests past their deadline are dropped at the next boundary. An id let go (`let_go`)
stays in the runtime until its next step: a copy of it delivered meanwhile is parked, and taken in after that step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

from nats.aio.msg import Msg

from appliance.errors import GatewayTimeout, deadline_passed
from appliance.generation_held import HeldGenerations
from appliance.generation_replies import GenerationReplies
from appliance.metrics import Metrics
from appliance.recent_answers import RecentAnswers
from appliance.residency import Residency
from runtimes.generate import GenerateRuntime, StepOutput

log = logging.getLogger(__name__)


class DecodeLoop:
    """Steps one model's decode batch, the requests in `held.streams`, and sends what each step made."""

    def __init__(
        self,
        model: str,
        runtime: GenerateRuntime,
        device_executor: Executor,
        residency: Residency,
        metrics: Metrics,
        held: HeldGenerations,
        replies: GenerationReplies,
        answered: RecentAnswers,
        *,
        take: Callable[[Msg], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._model = model
        self._runtime = runtime
        self._device = device_executor
        self._residency = residency
        self._metrics = metrics
        self._held = held
        self._replies = replies
        self._answered = answered
        self._take = take  # the worker's intake: a parked copy comes in through it
        self._spawn = spawn  # the worker's background tasks, waited for at its drain
        # Ids let go (`cancel`, `hand_back`) that the runtime holds until its next step, and copies of them delivered
        # meanwhile, taken in after it: admitted at once, the runtime refused such a copy ("already generating"), a
        # 422 to a generation its gateway published again after a NATS restart (tester h85).
        self._letting_go: set[str] = set()
        self._parked: list[Msg] = []
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A request joined, or a copy was parked: step (or take it in) now."""
        self._wake.set()

    def let_go(self, request_id: str) -> None:
        """Have the runtime drop it at its next step; a copy delivered before then waits for it (`_stepped`)."""
        self._runtime.cancel(request_id)
        self._letting_go.add(request_id)

    def parks(self, request_id: str, msg: Msg) -> bool:
        """Whether `msg` waits for the runtime to drop the copy let go before it (then taken in after that step)."""
        if request_id not in self._letting_go:
            return False
        self._parked.append(msg)
        self._wake.set()
        return True

    def clear(self) -> list[Msg]:
        """At a drain, the stepping stopped: the copies parked, to be handed back; nothing is let go any more."""
        parked, self._parked = self._parked, []
        self._letting_go.clear()
        return parked

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            let_go = set(self._letting_go)  # before this step: out of the runtime once it has run
            if not self._runtime.has_work:
                self._stepped(let_go)  # the runtime holds none of them
                self._wake.clear()
                await self._wake.wait()
                continue
            self._drop_expired()
            self._residency.touch(self._model)  # generating is using: not the model evicted for an idle one
            started = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._device, self._runtime.step)
            except Exception as exc:
                log.error("decode step failed", extra={"model": self._model, "error": repr(exc)})
                # The requests that ran in it (decoding, or joining) are dropped, each owed a retry or an
                # error; those waiting to join never ran: they join at the next step, no delivery spent.
                for request_id in await loop.run_in_executor(self._device, self._runtime.drop_decoding):
                    stream = self._held.forget(request_id)
                    if stream is not None:
                        self._replies.failed(stream, exc)
                self._stepped(let_go)  # this step dropped them from the runtime
                continue
            self._stepped(let_go)  # dropped by this step
            elapsed_ms = (time.perf_counter() - started) * 1000
            self._metrics.compute_ms.labels(self._model).observe(elapsed_ms)
            self._metrics.batch_size.labels(self._model).observe(len(outputs))
            self._metrics.rows_computed.labels(self._model).inc(len(outputs))
            for output in outputs:
                try:
                    await self._send(output, elapsed_ms)
                except Exception as exc:  # a chunk not sent (the outbound buffer full in a reconnect, say)
                    self._not_sent(output.request_id, exc)

    def _stepped(self, let_go: set[str]) -> None:
        """A step has run, or the runtime holds nothing: the ids in `let_go` (as they were before it) are out of it,
        and copies of them delivered meanwhile are taken in."""
        self._letting_go -= let_go
        parked, self._parked = self._parked, []
        for msg in parked:
            self._take(msg)

    def _not_sent(self, request_id: str, error: Exception) -> None:
        """A chunk that could not be sent fails its request alone; the stepping goes on for the others."""
        log.warning("chunk not sent", extra={"model": self._model, "request_id": request_id, "error": repr(error)})
        self._runtime.cancel(request_id)
        stream = self._held.forget(request_id)
        if stream is not None:
            self._replies.failed(stream, error)

    def _drop_expired(self) -> None:
        now_ms = time.time() * 1000
        for request_id, stream in list(self._held.streams.items()):
            if now_ms >= stream.meta.deadline_ms:
                self._runtime.cancel(request_id)
                self._held.forget(request_id)
                self._metrics.expired.labels(self._model).inc()
                error = deadline_passed(request_id)
                if stream.tokens:
                    error = GatewayTimeout(
                        f"request {request_id} reached its deadline after {stream.tokens} generated tokens; "
                        "raise its `timeout`, or ask for fewer tokens"
                    )
                self._spawn(self._replies.fail(stream.meta, stream.msg, error, seq=stream.seq))

    async def _send(self, output: StepOutput, step_ms: float) -> None:
        stream = self._held.streams.get(output.request_id)
        if stream is None:
            return  # cancelled or expired meanwhile
        if output.error is not None:
            log.error(  # its prefill, or logits with nothing finite to choose from: failed alone, the batch goes on
                "request failed",
                extra={"model": self._model, "request_id": output.request_id, "error": repr(output.error)},
            )
            self._held.forget(output.request_id)
            self._replies.failed(stream, output.error)
            return
        stream.tokens += 1
        if stream.tokens == 1 and stream.meta.sent_ms:  # its first step: queued until that step started
            started_ms = time.time() * 1000 - step_ms
            self._metrics.queue_ms.labels(self._model).observe(max(0.0, started_ms - stream.meta.sent_ms))
        if not output.text_delta and not output.finished:
            return  # nothing stable to show yet (a half-made character, a possible stop string)
        if output.finished:
            self._held.forget(output.request_id)
        await self._replies.send(stream, output, step_ms)
        if output.finished:
            self._answered.add(stream.meta)
            self._residency.touch(self._model, answered=1)  # its demand: eviction takes the least asked for
