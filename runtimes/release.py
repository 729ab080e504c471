"""Giving a closed model's memory back: collected at once (its modules hold reference cycles), CUDA's cache returned.

The one idea: the collection is the costly part (0.3-0.7 s a model with transformers loaded), so models closed
together (a box stopping) are collected once, after the last (`released_together`): one each, 30 resident models
took a box 10 s to stop, most of its 12 s bound (tester h88).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_together = 0  # `released_together` blocks open: closes within them leave the collection to the last one's end


def release(device_type: str) -> None:
    """After the last reference to a model is dropped: collect it, and return CUDA's cache on a CUDA device."""
    with _lock:
        if _together:
            return
    _collect(cuda=device_type == "cuda")


@contextmanager
def released_together() -> Iterator[None]:
    """Models closed within (in any thread) are collected once, as the block ends."""
    global _together
    with _lock:
        _together += 1
    try:
        yield
    finally:
        with _lock:
            _together -= 1
            last = _together == 0
        if last:
            _collect(cuda=True)


def _collect(*, cuda: bool) -> None:
    gc.collect()
    torch = sys.modules.get("torch")  # imported by a torch model's load: not here, where none ran
    if cuda and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
