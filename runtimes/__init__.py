"""Model execution only: backends (torch, ONNX Runtime, no-op) and task adapters behind one protocol.

Nothing here imports from `appliance` or `tui`, so runtimes can be tested and benchmarked alone.
"""

from runtimes.base import (
    InputTooLong,
    ModelInfo,
    ModelSource,
    Runtime,
    RuntimeKind,
    Task,
    Tokenized,
    UnknownAdapter,
    UnsupportedModel,
)
from runtimes.loader import load_runtime
from runtimes.release import released_together

__all__ = [
    "InputTooLong",
    "ModelInfo",
    "ModelSource",
    "Runtime",
    "RuntimeKind",
    "Task",
    "Tokenized",
    "UnknownAdapter",
    "UnsupportedModel",
    "load_runtime",
    "released_together",
]
