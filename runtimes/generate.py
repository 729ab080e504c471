"""Causal-LM generation for many requests at once: one decode batch that requests join and leave.

The one idea is the step: `step()` advances every active request by one token in one forward pass
over the shared, left-padded KV cache (`runtimes/kv_batch.py`), then prefills the requests that
arrived since, and merges their caches into the batch. A request never waits for another to
finish, and a long one never holds the others back for more than one step. What one request makes
of its tokens (text, stop, usage) is `runtimes/decoding.py`; chat prompts are `runtimes/chat_prompt.py`.

How the serving side drives it (one runner thread per model calls `step`; `add` and `cancel` may be
called from any thread):

    prompt = runtime.apply_chat_template(messages)           # chat: ids from the model's template
    prompt = runtime.tokenize([text])[0].ids                 # completions: plain text
    runtime.add(request_id, prompt, SamplingParams(max_tokens=64, temperature=0.7, stop=("\\n\\n",)),
                adapter=None)                                # InputTooLong, UnknownAdapter, ValueError
    while runtime.has_work:
        for out in runtime.step():                           # StepOutput per active request
            stream(out.request_id, out.text_delta)           # out.usage is set on the last one
    runtime.cancel(request_id)                               # client gone: dropped at the next step
    runtime.drop_decoding()                                  # after a failed step: ids owed a retry or an error
    runtime.clear()                                          # drop everything (a drain): ids owed an answer
                                                             # (out.error: that request alone failed)

Greedy decoding (temperature 0) gives the tokens `model.generate(do_sample=False)` gives for the
prompt alone; a seeded request draws the same tokens every time. Models are loaded from local
files only and never with `trust_remote_code`; models whose attention is not full attention on
every layer (sliding windows, linear attention) are refused, since the batch cache assumes it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtimes.base import AdapterInUse, InputTooLong, ModelInfo, ModelSource, Task, Tokenized, max_decode_batch
from runtimes.causal_lm import check_full_attention, default_params, eos_ids
from runtimes.chat_prompt import (
    DEFAULT_CONTROLS,
    ChatPrompts,
    ChatTemplateError,
    ReservedTemplateVariable,
    TemplateControls,
)
from runtimes.decoding import Decoding, NoFiniteLogits, StepOutput, Usage
from runtimes.inbox import Inbox
from runtimes.kv_batch import CacheBatch
from runtimes.lora import LoraAdapters
from runtimes.tasks.generate import SamplingParams, TextStream, choose_tokens
from runtimes.tasks.penalties import Penalties
from runtimes.tokenizer import TextTokenizer, model_max_length
from runtimes.torch_backend import _DTYPES, cuda_peak_since, cuda_peak_start, load_torch_model, release

__all__ = [
    "ChatTemplateError",
    "GenerateRuntime",
    "ReservedTemplateVariable",
    "SamplingParams",
    "StepOutput",
    "TemplateControls",
    "Usage",
]


class GenerateRuntime:
    """A causal LM on one device, decoding a changing set of requests together."""

    def __init__(self, source: ModelSource) -> None:
        if source.threads:
            torch.set_num_threads(source.threads)
        self.device = torch.device(source.device)
        model = load_torch_model(source.path, Task.GENERATE, _DTYPES[source.dtype]).to(self.device)
        check_full_attention(model.config, source.path)
        self.model = model
        self._vocab = model.get_input_embeddings().num_embeddings
        self._adapters = LoraAdapters(model)
        context = model_max_length(source.path)
        # A prompt leaves room for at least one new token; over-long prompts lose their beginning.
        self.tokenizer = TextTokenizer(source.path, max_length=context - 1, keep="end")
        self._eos = eos_ids(model, self.tokenizer, source.path)
        self.defaults = default_params(source.path)
        accepted = set(inspect.signature(model.forward).parameters)
        self._cache_kwarg = "cache" if "cache" in accepted else "past_key_values"
        self._keep_last_logits = "logits_to_keep" in accepted
        self._max_rows = max_decode_batch(source.options)
        self._max_prefill_tokens = int(source.options.get("max_prefill_tokens", 8192))
        self._chat = ChatPrompts(source.path, self.tokenizer)
        self._inbox: Inbox[Decoding] = Inbox()
        self._step_lock = threading.Lock()
        # A step (taking requests, then running them) and an adapter's unload exclude each other: an adapter
        # found unused, then unloaded while a step ran a request it had just taken, failed that whole step.
        self._adapter_lock = threading.Lock()
        self._rows: list[Decoding] = []  # owned by the stepping thread, with `_batch`
        self._batch: CacheBatch | None = None
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        peak, self.kv_bytes_per_token = self._warm_up()
        self.info = ModelInfo(task=Task.GENERATE, max_length=context, nbytes=weights + peak)

    # -- inputs ---------------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        """Completion prompts, special tokens added as the model expects; truncation keeps the end."""
        return self.tokenizer.tokenize(texts, truncate=truncate)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        truncate: bool = False,
        controls: TemplateControls = DEFAULT_CONTROLS,
    ) -> np.ndarray:
        """Prompt ids for a chat, rendered with the model's own template (`runtimes/chat_prompt.py`)."""
        return self._chat.render(messages, truncate=truncate, controls=controls)

    # -- requests -------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        *,
        adapter: str | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next step boundary."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        prompt = torch.as_tensor(ids, device=self.device)
        if prompt.ndim != 1 or prompt.numel() == 0:
            raise ValueError("a prompt is a non-empty sequence of token ids")
        room = self.info.max_length - prompt.numel()
        if room < 1:
            raise InputTooLong(0, self.info.max_length - 1)
        if int(ids.max()) >= self._vocab or int(ids.min()) < 0:
            # A tokenizer with more tokens than the model embeds: the id would fail the prefill.
            bad = int(ids[(ids >= self._vocab) | (ids < 0)][0])
            raise ValueError(
                f"the prompt has token {bad} ({self.tokenizer.decode([bad])!r}), which the model does not have "
                f"(it embeds {self._vocab}): its tokenizer does not match it; leave that text out"
            )
        self._adapters.check([adapter])
        unknown = [t for t, _ in params.logit_bias if not 0 <= t < self._vocab]
        if unknown:
            raise ValueError(
                f"logit_bias names token {unknown[0]}, which the model does not have (it has {self._vocab})"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(_generator_seed(params.seed, self.device))
        request = Decoding(
            request_id=request_id,
            prompt=prompt,
            params=params,
            adapter=adapter,
            max_new=min(params.max_tokens, room),
            stream=TextStream(self.tokenizer.decode, ids.tolist(), params.stop),
            generator=generator,
            penalties=Penalties(params, torch.from_numpy(ids)) if params.reshapes else None,  # host ids: no device sync
        )
        self._inbox.add(request)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step boundary; it gets no further output."""
        self._inbox.cancel(request_id)

    @property
    def has_work(self) -> bool:
        return self._inbox.has_work

    @property
    def decode_batch(self) -> int:
        """The most requests one decode step advances (`options.max_batch_size`)."""
        return self._max_rows

    @property
    def active(self) -> int:
        """Requests in the decode batch now (not counting those waiting to join)."""
        return len(self._rows)

    def drop_decoding(self) -> list[str]:
        """After a failed step: drop every request but those waiting to join (the decode batch, whose
        cache is suspect); returns their ids. Those waiting never ran: they join at the next step.

        Call it from the stepping thread, between steps: the caller owes each id a retry or an error.
        """
        self._rows, self._batch = [], None
        return self._inbox.forget_running()

    def clear(self) -> list[str]:
        """Drop every request, waiting or decoding (a drain); returns their ids.

        Call it from the stepping thread, between steps: the caller owes each id an answer.
        """
        self._rows, self._batch = [], None
        return self._inbox.clear()

    # -- decoding -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Advance every active request by one token and admit waiting ones; one output per request."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("step() is already running: one thread drives a generate runtime")
        self._adapter_lock.acquire()
        joining: list[Decoding] = []
        try:
            room = self._max_rows - len(self._rows)
            joining, cancelled = self._inbox.take(room, self._max_prefill_tokens, lambda r: r.prompt.numel())
            self._drop(cancelled, forget=False)
            outputs: list[StepOutput] = []
            if self._rows:
                outputs += self._choose(self._rows, self._decode())
            if joining:
                outputs += self._join(joining)
            self._drop({o.request_id for o in outputs if o.finished or o.error is not None})
            return outputs
        except BaseException:
            # Taken for this step but never run (not prefilled) when it failed: they join at a later one.
            # One that ran (joined, or finished on its first token) is the caller's, like the batch's.
            running = {r.request_id for r in self._rows}
            self._inbox.put_back([r for r in joining if not r.generated and r.request_id not in running])
            raise
        finally:
            self._adapter_lock.release()
            self._step_lock.release()

    def _join(self, joining: list[Decoding]) -> list[StepOutput]:
        """Prefill requests into the decode batch; a failing prefill is split until the culprit is alone.

        The decode batch is untouched until a prefill and its merge succeed, so one request that cannot
        be prefilled (out of memory with a long prompt, say) fails alone, not every request decoding.
        """
        try:
            batch, logits = self._prefill([r.prompt for r in joining], [r.adapter for r in joining])
            # The merge copies the whole cache, widened to the longest row: as likely to run out of
            # memory as the prefill, and failing the same way. Before sampling, so that a seeded
            # request retried in a split draws what it would have drawn.
            merged = batch if self._batch is None else self._batch.merge(batch)
            tokens = self._choose_for(joining, logits)
        except Exception as exc:
            # Kept without its traceback, whose frames hold the failed attempt's tensors: the retries
            # below (out of memory, say) must not run with that memory still taken.
            failure = exc.with_traceback(None)
        else:
            failure = None
        if failure is not None:
            if len(joining) == 1:
                return [StepOutput(joining[0].request_id, -1, "", finished=True, error=failure)]
            half = len(joining) // 2
            return self._join(joining[:half]) + self._join(joining[half:])
        self._batch = merged
        self._rows += joining
        return self._emit(joining, tokens)

    def _drop(self, request_ids: set[str], *, forget: bool = True) -> None:
        if not request_ids:
            return
        keep = [i for i, r in enumerate(self._rows) if r.request_id not in request_ids]
        if len(keep) != len(self._rows):
            # The cache first: its copy may fail (out of memory), and then the rows must still match it.
            self._batch = self._batch.keep(keep) if keep and self._batch is not None else None
            self._rows = [self._rows[i] for i in keep]
        if forget:
            self._inbox.forget(request_ids)

    def _decode(self) -> torch.Tensor:
        assert self._batch is not None
        batch = self._batch
        mask, positions = batch.step_inputs()
        last = torch.tensor([[r.generated[-1]] for r in self._rows], dtype=torch.long, device=self.device)
        logits = self._forward([r.adapter for r in self._rows], last, mask, positions, batch.cache)
        batch.advance(mask)
        return logits

    def _prefill(
        self, prompts: list[torch.Tensor], adapters: list[str | None], *, keep_cache: bool = True
    ) -> tuple[CacheBatch, torch.Tensor]:
        batch, ids = CacheBatch.prompts(prompts, self.tokenizer.pad_id, self.device)
        cache = batch.cache if keep_cache else None
        logits = self._forward(adapters, ids, batch.mask, batch.prompt_position_ids(), cache)
        return batch, logits

    def _forward(
        self, adapters: list[str | None], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Last-position logits, float32 (rows, vocab); `cache` None runs without one."""
        inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if cache is not None:
            inputs |= {self._cache_kwarg: cache, "use_cache": True}
        else:
            inputs["use_cache"] = False
        if self._keep_last_logits:
            inputs["logits_to_keep"] = 1
        output = self._adapters(adapters, **inputs)
        return output.logits[:, -1, :].float()

    def _choose(self, requests: list[Decoding], logits: torch.Tensor) -> list[StepOutput]:
        return self._emit(requests, self._choose_for(requests, logits))

    @staticmethod
    def _choose_for(requests: list[Decoding], logits: torch.Tensor) -> list[int | None]:
        seen = [r.penalties for r in requests]
        return choose_tokens(logits, [r.params for r in requests], [r.generator for r in requests], seen)

    def _emit(self, requests: list[Decoding], tokens: list[int | None]) -> list[StepOutput]:
        """Each request's output for its token; one the model gave no finite logits (None) fails, dropped by `step`."""
        return [
            request.emit(token, self._eos)
            if token is not None
            else StepOutput(request.request_id, -1, "", finished=True, error=NoFiniteLogits(self.model.dtype))
            for request, token in zip(requests, tokens, strict=True)
        ]

    # -- whole batches, without generating -------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: Sequence[Tokenized], adapter: str | None = None) -> np.ndarray:
        """Next-token logits (n, vocab) for each prompt: one forward pass, no cache kept."""
        prompts = [torch.as_tensor(row.ids, device=self.device) for row in batch]
        _, logits = self._prefill(prompts, [adapter] * len(prompts), keep_cache=False)
        return logits.cpu().numpy()

    @torch.inference_mode()
    def _warm_up(self) -> tuple[int, int]:
        """Prefill a long prompt: (activation peak, KV cache bytes per token).

        The peak is measured on CUDA and estimated on CPU from the prompt's KV cache. The bytes per
        token are what each token of each active request adds: the budget a batch grows against.
        """
        length = min(self.tokenizer.max_length, 512)
        allocated = cuda_peak_start(self.device) if self.device.type == "cuda" else 0
        batch, _ = self._prefill([torch.ones(length, dtype=torch.long, device=self.device)], [None])
        layers = batch.cache.layers
        cache_bytes = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        if self.device.type == "cuda":
            return cuda_peak_since(self.device, allocated), cache_bytes // length
        return 4 * cache_bytes, cache_bytes // length

    # -- LoRA adapters (runtimes/lora.py) -----------------------------------------------------------

    def load_adapter(self, name: str, path: Path) -> int:
        return self._adapters.load(name, path)

    def evict_adapter(self, name: str) -> None:
        """Refused while a request uses the adapter: let it finish or cancel it first."""
        with self._adapter_lock:
            if any(r.adapter == name for r in (*self._inbox.waiting(), *self._rows)):
                raise AdapterInUse(f"LoRA adapter {name!r} is in use by a generating request")
            self._adapters.evict(name)

    @property
    def adapters(self) -> tuple[str, ...]:
        return self._adapters.names

    def close(self) -> None:
        self._rows, self._batch = [], None
        self._adapters.close()
        del self.model
        release(self.device)


def _generator_seed(seed: int, device: torch.device) -> int:
    """A request's signed 64-bit seed as its generator's, every bit of it mattering. A CPU generator (mt19937)
    keeps only the low 32 bits of what it is given, so seeds 1 and 2**32 + 1 gave one sample: there the 64 bits
    are mixed (splitmix64's finaliser) and folded to 32. A CUDA generator (Philox) takes all 64 as they are."""
    if device.type != "cpu":
        return seed
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF
