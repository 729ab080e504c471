"""The torch backend: a transformers model in inference mode on one device.

The model class follows the task (encoder for `embed`, a sequence or token classification head for
the others), loaded from a local folder only: no hub, no `trust_remote_code`. A folder whose weights do
not cover the model its config.json describes is refused, not served with random weights in the gaps; only
a classifier's head may be missing (`untrained_head`), for a LoRA base whose adapters each carry their own.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from runtimes.base import HEAD_MODULES, ModelSource, Task, UnsupportedModel
from runtimes.lora import LoraAdapters
from runtimes.release import release as release_memory

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _model_class(task: Task):
    import transformers

    return {
        Task.EMBED: transformers.AutoModel,
        Task.SCORE: transformers.AutoModelForSequenceClassification,
        Task.CLASSIFY: transformers.AutoModelForSequenceClassification,
        Task.EXTRACT: transformers.AutoModelForTokenClassification,
        Task.GENERATE: transformers.AutoModelForCausalLM,
    }[task]


class TorchBackend:
    def __init__(self, source: ModelSource) -> None:
        if source.threads:
            torch.set_num_threads(source.threads)
        self.device = torch.device(source.device)
        self.dtype = _DTYPES[source.dtype]
        self.task = source.task
        model, self.untrained_head = load_torch_base(source.path, source.task, self.dtype)
        self.model = model.to(self.device)
        self.adapters = LoraAdapters(self.model, mixed_rows=False)  # an encoder batch runs one adapter
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            b.numel() * b.element_size() for b in self.model.buffers()
        )
        self._allocated = 0  # on CUDA, what was allocated when the peak was last reset (`start_peak`)

    @torch.inference_mode()
    def forward(
        self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None, adapter: str | None = None
    ) -> np.ndarray:
        """`adapter`: a LoRA adapter loaded through `self.adapters`, applied to every row."""
        inputs = {
            "input_ids": torch.from_numpy(ids).to(self.device, non_blocking=True),
            "attention_mask": torch.from_numpy(mask).to(self.device, non_blocking=True),
        }
        if type_ids is not None and self._accepts_token_types:
            inputs["token_type_ids"] = torch.from_numpy(type_ids).to(self.device, non_blocking=True)
        output = self.adapters(None if adapter is None else [adapter] * ids.shape[0], **inputs)
        main = output.last_hidden_state if self.task is Task.EMBED else output.logits
        return main.float().cpu().numpy()

    @property
    def _accepts_token_types(self) -> bool:
        return getattr(self.model.config, "type_vocab_size", 0) > 0

    def start_peak(self) -> None:
        """Measure the allocator's peak from now (`peak_activation_bytes`), on CUDA."""
        if self.device.type == "cuda":
            self._allocated = cuda_peak_start(self.device)

    def peak_activation_bytes(self) -> int | None:
        """The allocator's peak above what was allocated at `start_peak`, on CUDA; None elsewhere."""
        if self.device.type != "cuda":
            return None
        return cuda_peak_since(self.device, self._allocated)

    def close(self) -> None:
        self.adapters.close()
        del self.model
        release(self.device)


def release(device: torch.device) -> None:
    """After the last reference to a model is dropped: collect it (modules hold cycles), return CUDA's cache; once
    for models closed together (`runtimes.release.released_together`)."""
    release_memory(device.type)


# transformers builds a model on the meta device through process-wide hooks, then ties and fills its weights: two
# builds at once in one process (two cold models asked for together) left tied weights on the meta device in both
# ("Cannot copy out of meta tensor", 5 runs in 11). One build at a time; reading the weights is most of it anyway.
_BUILDING = threading.Lock()


def load_torch_model(folder: Path, task: Task, dtype: torch.dtype):
    """The model, with every weight it reads in its folder (an ONNX export or a generator has no adapter head)."""
    model, untrained_head = load_torch_base(folder, task, dtype)
    if untrained_head:
        del model
        gc.collect()
        raise UnsupportedModel(f"the weights in {folder} hold no head ({', '.join(untrained_head)}); {_NO_HEAD}")
    return model


_NO_HEAD = "it answers only through LoRA adapters that bring their own (modules_to_save), on the torch runtime"


def load_torch_base(folder: Path, task: Task, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """The model, and the weights of its head its folder lacks: a LoRA base whose adapters each carry their own
    head (`modules_to_save`, runtimes/lora.py). Any other weight missing is refused."""
    with _BUILDING:
        try:
            model, loading = _model_class(task).from_pretrained(
                str(folder), dtype=dtype, local_files_only=True, trust_remote_code=False, output_loading_info=True
            )
        except RuntimeError as exc:
            if "ignore_mismatched_sizes" not in str(exc):
                raise
            # transformers' own words point at "the above report", which is in the box's log, not the client's answer.
            raise UnsupportedModel(
                f"{folder}: its weights are not shaped as its config.json says (a hidden_size, vocab_size or label "
                "count that differs from the weights'?); the box's log lists each weight that does not fit"
            ) from exc
        missing = uncovered(loading["missing_keys"], task)
        head = tuple(key for key in missing if key.split(".")[0] in HEAD_MODULES) if task in _HEADED else ()
        if head:
            log.warning(
                "model head not in the weights: only its adapters' own heads answer",
                extra={"folder": str(folder), "missing": ", ".join(head)},
            )
            missing = [key for key in missing if key not in head]
        if missing:
            total = len(model.state_dict())
            del model  # not kept alive by the exception's frame: a refused model's memory goes now
            gc.collect()
            raise UnsupportedModel(
                f"the weights in {folder} do not cover the model its config.json describes: {len(missing)} of its "
                f"{total} weights are missing, e.g. {', '.join(missing[:3])}; transformers would fill them with "
                "random values. The folder's config.json and weights do not match"
            )
    return model.eval(), head


def cuda_peak_start(device: torch.device) -> int:
    """Bytes allocated on `device` now, with its peak reset: `cuda_peak_since` then reads a load's own peak."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_peak_since(device: torch.device, allocated: int) -> int:
    """The allocator's peak on `device` above `allocated` (`cuda_peak_start`'s): the warm-up's own activations. Above
    the weights alone, it counted every other model resident on the device, and a load that fit was refused."""
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return max(0, peak - allocated)


# Tasks with a head on a backbone: a LoRA adapter may carry its own trained head, so a base without one loads.
_HEADED = frozenset({Task.SCORE, Task.CLASSIFY, Task.EXTRACT})


def uncovered(missing_keys: Iterable[str], task: Task) -> list[str]:
    """The weights a load left randomly initialised that the task's answers depend on, in layer order.

    transformers has already dropped what it expects to be absent (tied heads, buffers it rebuilds). An embedding
    reads the last hidden state, never the pooler that `AutoModel` adds: encoders saved without one
    (`add_pooling_layer=False`, a token classifier's backbone) embed exactly as trained.
    """
    keys = [key for key in missing_keys if not (task is Task.EMBED and "pooler" in key.split("."))]
    return sorted(
        keys, key=lambda key: [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split(".")]
    )
