"""Settings resolved from their sources (flags > `FBX_*` environment > the `--config` TOML file > defaults), and
what is wrong with them said the way an operator reads it: one line per setting, `field: the rule (got value)`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from appliance.settings import MODEL_NAME_RULE, ModelEntry, Settings

_NOT_SETTINGS = frozenset({"FBX_CONFIG"})  # variables read beside the settings: the TOML file's path


def unknown_variables(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """`FBX_MAX_BATCH_TOKEN is not a setting (did you mean FBX_MAX_BATCH_TOKENS?)` for each `FBX_*` variable that
    names no setting: the environment source reads only its fields' variables, so a misspelt one did nothing."""
    known = {f"FBX_{field.upper()}" for field in Settings.model_fields} | _NOT_SETTINGS
    return [
        f"{name} is not a setting{_did_you_mean(name, known)}; ignored"
        for name in sorted(environ)
        if name.startswith("FBX_") and name not in known
    ]


def _did_you_mean(name: str, known: set[str] | list[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)  # FBX_FOO is no near miss of FBX_ROLE
    return f" (did you mean {close[0]}?)" if close else ""


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Resolve settings; `overrides` are the CLI flags the user actually gave (None = not given)."""
    config_file = config_file or (Path(os.environ["FBX_CONFIG"]) if os.environ.get("FBX_CONFIG") else None)
    settings_cls: type[Settings] = Settings
    if config_file is not None:
        settings_cls = type("Settings", (Settings,), {"config_file_values": _read_config_file(config_file)})
    try:
        return settings_cls(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        raise ValueError(_unparsed_variable(exc)) from None


def _read_config_file(config_file: Path) -> dict[str, Any]:
    """The TOML file's tables, read once: a pipe is a config file too (`--config <(...)`), and it reads only once.
    pydantic-settings' own TOML source reads only regular files: it skipped a pipe in silence, unknown keys and
    all."""
    if config_file.is_dir() or not config_file.exists():
        what = "is a folder, not a file" if config_file.is_dir() else "does not exist"
        raise FileNotFoundError(f"config file {config_file} {what}")
    try:
        return tomllib.loads(config_file.read_bytes().decode())
    except tomllib.TOMLDecodeError as exc:  # its message has the line and column, but not the file
        raise ValueError(f"config file {config_file}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {config_file}: not UTF-8 text (byte {exc.start})") from None


def _unparsed_variable(exc: SettingsError) -> str:
    """`FBX_MODELS: not valid JSON (Expecting value: line 1 column 1 (char 0))`, for pydantic-settings' `error
    parsing value for field "models" from source "EnvSettingsSource"`, which names neither the variable nor
    the place."""
    field = re.search(r'field "(\w+)"', str(exc))
    variable = f"FBX_{field.group(1).upper()}" if field else "an FBX_* variable"
    if isinstance(exc.__cause__, json.JSONDecodeError):
        return f"{variable}: not valid JSON ({exc.__cause__})"
    return f"{variable}: {exc.__cause__ or exc}"


_PATTERN_RULES = {  # what a pattern means, for the fields whose pattern an operator types
    "box_id": "use 1 to 64 letters, digits, '-' or '_'",
    "device": "use auto, cpu, cuda or cuda:N",
}


_SECRET_FIELDS = ("api_keys", "admin_keys")


class SettingsProblems(ValueError):
    """Several settings wrong at once (every `[[models]]` entry that cannot be served), said one a line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def settings_problems(exc: BaseException) -> list[str]:
    """One line per invalid setting, `field: what is wrong (got value)`, for the CLI's refusal.

    pydantic's own text spans several lines per field and links its docs; an operator needs the
    setting, the rule and the value given.
    """
    if isinstance(exc, SettingsProblems):
        return exc.problems
    if not isinstance(exc, ValidationError):
        return [str(exc) or type(exc).__name__]
    lines = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        if error["type"] == "string_pattern_mismatch" and where in _PATTERN_RULES:
            message = _PATTERN_RULES[where]
        elif error["type"] == "string_pattern_mismatch" and error["loc"][:1] == ("models",):
            message = MODEL_NAME_RULE  # a name or an alias: the API's words, not the pattern (tester h199)
        if error["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted"
            fields = ModelEntry.model_fields if error["loc"][0] == "models" else Settings.model_fields
            message = f"not a setting{_did_you_mean(str(error['loc'][-1]), list(fields))}"
        secret = where in _SECRET_FIELDS  # keys are never printed, not even in a refusal
        if (
            not secret
            and error["type"] != "extra_forbidden"
            and isinstance(given, str | int | float)
            and not isinstance(given, bool)
            and not _names(message, given)
        ):
            message += f" (got {given!r})"
        lines.append(f"{where}: {message}")
    return lines


def _names(message: str, given: str | int | float) -> bool:
    """Whether a message names the value given, as a rule of ours does (quoted, or in brackets); pydantic's "greater
    than 0" does not name a 0 given."""
    return f"'{given}'" in message or f"({given})" in message
