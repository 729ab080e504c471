"""Loads a `ModelSource` into a `Runtime`: picks the backend by runtime kind and the head by task."""

from __future__ import annotations

from runtimes.base import ModelSource, Runtime, RuntimeKind, Task


def load_runtime(source: ModelSource) -> Runtime:
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
