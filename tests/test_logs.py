"""The box's log: fleetbox's own JSON lines, with third-party chatter held back even at DEBUG."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.logs import configure_logging
from runtimes import Task
from runtimes.onnx_backend import GraphSession, SessionConfig
from runtimes.onnx_export import Forward, ensure_exported


@pytest.fixture
def box_logging() -> Iterator[None]:
    """`configure_logging` changes the process's logging; put it back for the other tests."""
    root = logging.getLogger()
    handlers, level, filters = root.handlers[:], root.level, root.filters[:]
    loggers = [logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    levels = [(logger, logger.level) for logger in loggers]
    yield
    root.handlers[:], root.filters[:] = handlers, filters
    root.setLevel(level)
    for logger, held in levels:
        logger.setLevel(held)


def _loggers(stderr: str) -> list[str]:
    return [json.loads(line)["logger"] for line in stderr.splitlines() if line.startswith("{")]


def test_an_onnx_export_logs_one_fleetbox_line_even_at_debug(encoder_dir: Path, tmp_path, capsys, box_logging) -> None:
    """onnx_ir's graph passes logged ~115 INFO lines an export (449 more at DEBUG) around fleetbox's one."""
    configure_logging("DEBUG")

    def open_graph(path: Path) -> Forward:
        return GraphSession(path, Task.EMBED, SessionConfig()).forward

    ensure_exported(encoder_dir, Task.EMBED, "float32", tmp_path, open_graph)
    assert _loggers(capsys.readouterr().err) == ["runtimes.onnx_export"]


def test_a_library_logging_on_the_root_logger_is_held_at_warning(capsys, box_logging) -> None:
    """onnxruntime's int8 quantisation calls `logging.info()` itself, a line per tensor: no name to hold."""
    configure_logging("DEBUG")
    logging.info("Quantization parameters for tensor:'x' not specified")
    logging.warning("worth a look")
    logging.getLogger("appliance.app").debug("fleetbox's own debug line")
    assert _loggers(capsys.readouterr().err) == ["root", "appliance.app"]
