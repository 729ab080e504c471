"""Runtime tests run alone on one torch thread; the model folders come from tests/models.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.models import ADAPTER_KINDS, BIO_LABELS, CLASS_LABELS

__all__ = ["ADAPTER_KINDS", "BIO_LABELS", "CLASS_LABELS"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Models this small run fastest on one thread, and a busy 2-core machine makes OpenMP's spinning
    threads crawl; restored after each module so the rest of the suite keeps its setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
