"""Loads a `ModelSource` into a `Runtime`: picks the backend by runtime kind and the head by task."""

from __future__ import annotations

import threading

from runtimes.base import ModelFolderMissing, ModelSource, Runtime, RuntimeKind, Task

_imports_lock = threading.Lock()
_imported = False


def import_model_libraries() -> None:
    """Import transformers' model classes, its cache and peft once, in one thread at a time.

    transformers resolves its names lazily, and that first import is not safe from two threads: a box whose
    first two loads ran at once (two pinned models, or two cold models asked for together) had one of them
    fail with `no attribute 'AutoModel'` or `cannot import name 'DynamicCache'`, cached as that model's load
    error (503 for 30 s, a pinned model left unloaded). Every load goes through here first.
    """
    global _imported
    if _imported:
        return
    with _imports_lock:
        if _imported:
            return
        import peft  # noqa: F401  # imports transformers' modeling code as well
        import transformers

        for name in (
            "AutoConfig",
            "AutoModel",
            "AutoModelForSequenceClassification",
            "AutoModelForTokenClassification",
            "AutoModelForCausalLM",
            "AutoTokenizer",
            "DynamicCache",
        ):
            getattr(transformers, name)
        _imported = True


def load_runtime(source: ModelSource) -> Runtime:
    if source.runtime is not RuntimeKind.NOOP:
        if not source.path.is_dir():  # transformers would take the path for a hub repo id and say so
            raise ModelFolderMissing(
                f"the model folder {source.path} does not exist (moved or deleted since it was registered?)"
            )
        import_model_libraries()
    if source.runtime is RuntimeKind.NOOP:
        from runtimes.noop import NoopRuntime

        return NoopRuntime(source)
    if source.task is Task.GENERATE:
        if source.runtime is not RuntimeKind.TORCH:
            raise NotImplementedError(f"generation runs on the torch runtime, not {source.runtime}")
        from runtimes.generate import GenerateRuntime

        return GenerateRuntime(source)
    if source.runtime is RuntimeKind.TORCH:
        from runtimes.encoder import build_encoder_runtime
        from runtimes.torch_backend import TorchBackend

        return build_encoder_runtime(source, TorchBackend(source))
    if source.runtime is RuntimeKind.ONNX:
        from runtimes.encoder import build_encoder_runtime
        from runtimes.onnx_backend import OnnxBackend

        return build_encoder_runtime(source, OnnxBackend(source))
    raise NotImplementedError(f"runtime {source.runtime} is not available yet")
