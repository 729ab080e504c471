"""The torch backend: a transformers model in inference mode on one device.

The model class follows the task (encoder for `embed`, a sequence or token classification head for
the others), loaded from a local folder only: no hub, no `trust_remote_code`. A folder whose weights do
not cover the model its config.json describes is refused, not served with random weights in the gaps.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from runtimes.base import ModelSource, Task, UnsupportedModel
from runtimes.lora import LoraAdapters

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
        self.model = load_torch_model(source.path, source.task, self.dtype).to(self.device)
        self.adapters = LoraAdapters(self.model, mixed_rows=False)  # an encoder batch runs one adapter
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            b.numel() * b.element_size() for b in self.model.buffers()
        )

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

    def peak_activation_bytes(self) -> int | None:
        """The allocator's peak above the weights since the last reset, on CUDA; None elsewhere."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return max(0, peak - self.weight_bytes)

    def close(self) -> None:
        self.adapters.close()
        del self.model
        release(self.device)


def release(device: torch.device) -> None:
    """After the last reference to a model is dropped: collect it (modules hold cycles), return CUDA's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# transformers builds a model on the meta device through process-wide hooks, then ties and fills its weights: two
# builds at once in one process (two cold models asked for together) left tied weights on the meta device in both
# ("Cannot copy out of meta tensor", 5 runs in 11). One build at a time; reading the weights is most of it anyway.
_BUILDING = threading.Lock()


def load_torch_model(folder: Path, task: Task, dtype: torch.dtype):
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
        if missing:
            total = len(model.state_dict())
            del model  # not kept alive by the exception's frame: a refused model's memory goes now
            gc.collect()
            raise UnsupportedModel(
                f"the weights in {folder} do not cover the model its config.json describes: {len(missing)} of its "
                f"{total} weights are missing, e.g. {', '.join(missing[:3])}; transformers would fill them with "
                "random values. The folder's config.json and weights do not match"
            )
    return model.eval()


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
