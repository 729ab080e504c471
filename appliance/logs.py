"""Structured logs: one JSON line per event, with the `extra` fields (request id, model, box)."""

from __future__ import annotations

import logging
import sys
import time

import orjson

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        event.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(event, default=str).decode()


class MalformedHttpFilter(logging.Filter):
    """aiohttp logs a request it cannot parse at error level with the raw bytes, headers included: a
    client's key could land in the log, and anyone could flood it. The client already has its 400."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, HttpProcessingError)


class SaidAtDebug(logging.Filter):
    """A library's WARNING lines holding `marker` become DEBUG lines (shown only at DEBUG): warnings fleetbox has
    judged and acts on itself, said each time in words an operator cannot act on."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        if self.marker not in record.getMessage():
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def _say_at_debug(logger: str, marker: str) -> None:
    """Add `SaidAtDebug(marker)` to `logger`, once however often logging is configured."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, SaidAtDebug) and f.marker == marker for f in target.filters):
        target.addFilter(SaidAtDebug(marker))


# Libraries whose INFO and DEBUG lines say nothing an operator acts on. The ONNX export alone logged ~115 INFO
# lines from onnx_ir's graph passes ("Removed 186 unused nodes"), 449 more at DEBUG, around fleetbox's one line.
THIRD_PARTY_AT_WARNING = (
    "aiohttp.access",
    "transformers",
    "httpx",
    "onnx",
    "onnx_ir",
    "onnxscript",
    "onnxruntime",
    "torch.onnx",
)


class BelowWarning(logging.Filter):
    """On the root logger: drops the lines logged on it below WARNING. fleetbox logs through named loggers (whose
    lines pass no filter of the root's); a library that calls `logging.info()` itself (onnxruntime's int8
    quantisation, a line per tensor) cannot be held by name."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def configure_logging(level: str, *, runs_models: bool = False) -> None:
    """The box's log: JSON lines on stderr, libraries' included. A box that `runs_models` imports torch now (its
    first model would, at once) so that torch's own log handlers exist to be taken off before they write."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if not any(isinstance(existing, BelowWarning) for existing in root.filters):
        root.addFilter(BelowWarning())
    for noisy in THIRD_PARTY_AT_WARNING:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpFilter())
    # transformers' report of each checkpoint's missing and unused weights (a table, in ANSI bold): a bare encoder's
    # unused pooler warned on every load (tester h89). The box judges a folder's weights itself (one the model uses
    # missing is refused, a head it does not have is said: runtimes/torch_backend.py).
    _say_at_debug("transformers.modeling_utils", "LOAD REPORT")
    # An ONNX export says, four times, that torchvision's detection ops are not registered: nothing fleetbox uses.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    logging.captureWarnings(True)  # a library's `warnings.warn` is a JSON line (logger `py.warnings`), not raw text
    # peft's `UserWarning` on each adapter a box unloads ("Adapter fbx-adapter-7 was active which is now deleted.
    # Setting active adapter to ..."): the runtime makes the adapter it deletes active on purpose (runtimes/lora.py),
    # and the line, its text unique each time, was a WARNING per unload (soak tester h94: 86 in an hour of churn).
    _say_at_debug("py.warnings", "was active which is now deleted")
    _transformers_through_the_root()
    if runs_models:
        import torch  # noqa: F401
    _torch_through_the_root()


def _transformers_through_the_root() -> None:
    """transformers writes its warnings (a checkpoint's load report) as plain text through a handler of its own, and
    also through the root when the environment says `CI=true`: a line outside the JSON, or the same line twice. Its
    "Loading weights" bar on every load is not a line at all; the box logs each load's start and end itself."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()


def _torch_through_the_root() -> None:
    """torch writes its log records as plain text ("W1130 19:07:57.353000 21152 torch/onnx/...] ...") through
    stderr handlers of its own on its registered loggers, which do not propagate: the first start's ONNX export
    wrote ten such lines into the JSON log."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or not (name == "torch" or name.startswith("torch.")):
            continue
        own = [h for h in logger.handlers if type(h) is logging.StreamHandler]  # stderr's (not TORCH_LOGS_OUT's file)
        for handler in own:
            logger.removeHandler(handler)
        if own:  # not its trace log ("torch.__trace", every record at DEBUG, for TORCH_TRACE files only)
            logger.propagate = True


class FailureStreak:
    """A loop's repeated failure, logged once when it starts (WARNING) and once when it ends (INFO).

    A loop that retries every quarter second would flood the log at WARNING, and hide that it is
    failing at DEBUG; the repeats in between go to DEBUG. With `remind_s`, one repeat in so many seconds is a
    WARNING again, with the count (a box that cannot reach NATS says so while it lasts).
    """

    def __init__(
        self, logger: logging.Logger, what: str, *, event: str | None = None, remind_s: float | None = None
    ) -> None:
        self._log = logger
        self._what = what
        self._event = event or f"{what} failed"
        self._remind_s = remind_s
        self._failures = 0
        self._said_at = 0.0

    def failed(self, exc: BaseException, **extra: object) -> None:
        self._failures += 1
        now = time.monotonic()
        loud = self._failures == 1 or (self._remind_s is not None and now - self._said_at >= self._remind_s)
        if loud:
            self._said_at = now
        level = logging.WARNING if loud else logging.DEBUG
        self._log.log(level, self._event, extra={"error": repr(exc), "failures": self._failures, **extra})

    def succeeded(self) -> None:
        if self._failures:
            self._log.info(f"{self._what} works again", extra={"failures": self._failures})
            self._failures = 0
