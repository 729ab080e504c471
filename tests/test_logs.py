"""The box's log: fleetbox's own JSON lines, with third-party chatter held back even at DEBUG."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as transformers_logging

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
    transformers = logging.getLogger("transformers")
    transformers_handlers, transformers_propagate = transformers.handlers[:], transformers.propagate
    bars = transformers_logging.is_progress_bar_enabled()
    torch_logs = [(log, log.handlers[:], log.propagate) for log in loggers if log.name.startswith("torch")]
    yield
    logging.captureWarnings(False)
    for logger, handlers, propagate in torch_logs:
        logger.handlers[:], logger.propagate = handlers, propagate
    transformers.handlers[:], transformers.propagate = transformers_handlers, transformers_propagate
    if bars:
        transformers_logging.enable_progress_bar()
    root.handlers[:], root.filters[:] = handlers, filters
    root.setLevel(level)
    for logger, held in levels:
        logger.setLevel(held)


def _lines(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _loggers(stderr: str) -> list[str]:
    return [line["logger"] for line in _lines(stderr)]


def test_an_onnx_export_logs_one_fleetbox_line_even_at_debug(encoder_dir: Path, tmp_path, capsys, box_logging) -> None:
    """onnx_ir's graph passes logged ~115 INFO lines an export (449 more at DEBUG) around fleetbox's one."""
    configure_logging("DEBUG")

    def open_graph(path: Path) -> Forward:
        return GraphSession(path, Task.EMBED, SessionConfig()).forward

    ensure_exported(encoder_dir, Task.EMBED, "float32", tmp_path, open_graph)
    lines = _lines(capsys.readouterr().err)
    # The test encoder has no pooler weights: transformers' load report of them is a DEBUG line of its own.
    reports = [line for line in lines if "LOAD REPORT" in line["event"]]
    below_warning = [line["logger"] for line in lines if line["level"] in ("debug", "info") and line not in reports]
    assert below_warning == ["runtimes.onnx_export"]


def test_every_line_on_the_box_stderr_is_json_transformers_warnings_too(encoder_dir: Path, capsys, box_logging) -> None:
    """transformers printed a poolerless checkpoint's load report as plain text through a handler of its own (and
    through the root too, twice, where the environment says `CI=true`), and a "Loading weights" bar on every load."""
    from runtimes.torch_backend import load_torch_model

    configure_logging("DEBUG")
    load_torch_model(encoder_dir, Task.EMBED, torch.float32)
    err = capsys.readouterr().err
    assert err.strip(), "the test encoder has no pooler weights: transformers reports them missing"
    assert all(line.startswith("{") for line in err.strip().splitlines()), err
    reports = [line for line in _lines(err) if "LOAD REPORT" in line["event"]]
    # A DEBUG line: the box judges the weights itself, and an unused pooler warned on every load (tester h89).
    assert [(line["logger"], line["level"]) for line in reports] == [("transformers.modeling_utils", "debug")]
    configure_logging("INFO")
    load_torch_model(encoder_dir, Task.EMBED, torch.float32)
    assert not capsys.readouterr().err.strip()


def test_a_library_logging_on_the_root_logger_is_held_at_warning(capsys, box_logging) -> None:
    """onnxruntime's int8 quantisation calls `logging.info()` itself, a line per tensor: no name to hold."""
    configure_logging("DEBUG")
    logging.info("Quantization parameters for tensor:'x' not specified")
    logging.warning("worth a look")
    logging.getLogger("appliance.app").debug("fleetbox's own debug line")
    assert _loggers(capsys.readouterr().err) == ["root", "appliance.app"]


def test_torchs_own_log_lines_and_python_warnings_are_json_lines_too(capsys, box_logging) -> None:
    """torch wrote its records through stderr handlers of its own that do not propagate ("W1130 19:07:57.353000
    21152 torch/onnx/...] torchvision is not installed"), and libraries' `warnings.warn` printed raw text: ten
    plain lines in the log of a box's first start (black-box finding)."""
    configure_logging("INFO", runs_models=True)
    logging.getLogger("torch.onnx").warning("a torch warning")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err.strip() and all(line.startswith("{") for line in err.strip().splitlines()), err
    assert [(line["logger"], line["level"]) for line in _lines(err)] == [
        ("torch.onnx", "warning"),
        ("py.warnings", "warning"),
    ]


def test_pefts_word_on_each_adapter_unloaded_is_a_debug_line(capsys, box_logging) -> None:
    """Soak tester h94: peft warned "Adapter fbx-adapter-N was active which is now deleted" on every adapter a box
    unloaded (86 WARNING lines in an hour of churn), where the runtime makes it active on purpose. A DEBUG line;
    any other library warning stays a warning."""
    peft_says = "Adapter fbx-adapter-7 was active which is now deleted. Setting active adapter to x."
    for level in ("INFO", "DEBUG"):
        configure_logging(level)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn(peft_says, UserWarning, stacklevel=1)
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        said = [(line["level"], "now deleted" in line["event"]) for line in _lines(capsys.readouterr().err)]
        expected = [("warning", False)] if level == "INFO" else [("debug", True), ("warning", False)]
        assert said == expected, (level, said)


async def test_a_background_step_ended_by_its_models_deletion_is_not_a_warning(caplog) -> None:
    """Tester h89: a pin or load racing a delete (a documented outcome) logged "background step failed" at WARNING,
    49 times in a session; an operator reading warnings reads them as faults. Any other failure still warns."""
    from appliance.errors import NotFound, UnloadedWhileStarting
    from appliance.tasks import Background

    async def fails(exc: Exception) -> None:
        raise exc

    steps = Background("box")
    with caplog.at_level(logging.INFO, logger="appliance.tasks"):
        for exc in (NotFound("model 'm' was deleted while it loaded"), UnloadedWhileStarting("m"), RuntimeError("x")):
            steps.spawn(fails(exc))
        await steps.wait(5)
    levels = [(record.levelname, record.getMessage()) for record in caplog.records if record.name == "appliance.tasks"]
    gone = ("INFO", "background step ended: the model is gone")
    assert levels == [gone, gone, ("WARNING", "background step failed")]
    steps = {record.step for record in caplog.records if record.name == "appliance.tasks"}
    assert steps == {"test_a_background_step_ended_by_its_models_deletion_is_not_a_warning.<locals>.fails"}
