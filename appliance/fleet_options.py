"""The checks of the fleet commands' options and arguments (appliance/fleet_cli.py), made before any box is asked.

Each turns what nats-py or a box would answer late, or not at all, into one line on stderr and exit status 2:
a credentials or TLS file that cannot be used, a `--nats` with no URL, a MODEL or NAME no model can have, a
box id no box can have, a value not among an option's few, an option of one value given twice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from appliance.connect import NatsAuth

LOCAL_NATS = "nats://127.0.0.1:4222"


def creds_problem(path: Path) -> str | None:
    """Why `path` is not a usable NATS credentials file (a user JWT and its nkey seed), or None.

    Checked before connecting: nats-py reads the file only while it connects, and retries a
    missing or broken one with every attempt instead of saying what is wrong.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"creds: {path} does not exist"
    except (OSError, UnicodeDecodeError) as exc:
        return f"creds: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
    jwt = re.search(r"-{3,}BEGIN NATS USER JWT-{3,}\s*\n\s*(\S+)", text)
    seed = re.search(r"-{3,}BEGIN USER NKEY SEED-{3,}\s*\n\s*(\S+)", text)
    if jwt is None or seed is None:
        return f"creds: {path} is not a NATS credentials file (it needs a user JWT and a user nkey seed)"
    import nkeys

    try:
        nkeys.from_seed(bytearray(seed.group(1).encode()))
    except (nkeys.NkeysError, ValueError):
        return f"creds: {path}: the user nkey seed is not valid"
    return None


def check_creds_option(creds: Path | None) -> Path | None:
    """The `--creds` option of the fleet commands: a bad file is a one-line usage error."""
    problem = creds_problem(creds) if creds is not None else None
    if problem:
        typer.echo(f"fleetbox: {problem}", err=True)
        raise typer.Exit(2)
    return creds


def tls_problem(ca: Path | None, cert: Path | None, key: Path | None) -> str | None:
    """Why the TLS files cannot make a client context (missing, unreadable, a key not the certificate's), or None."""
    from appliance.connect import BadTlsFiles, client_tls

    try:
        client_tls(ca, cert, key)
    except BadTlsFiles as exc:
        return str(exc)
    return None


def nats_auth(creds: Path | None, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None) -> NatsAuth:
    """How the fleet commands join NATS; a bad TLS file is a one-line usage error, as a bad `--creds` is."""
    from appliance.connect import BadTlsFiles, NatsAuth, client_tls

    try:
        return NatsAuth(creds, client_tls(tls_ca, tls_cert, tls_key))
    except BadTlsFiles as exc:
        typer.echo(f"fleetbox: {exc}", err=True)
        raise typer.Exit(2) from None


def check_nats_option(nats: str) -> str:
    """The `--nats` option of the fleet commands: a list with no URL in it is a one-line usage error
    (nats-py, given no server, would try none of them for ever)."""
    from appliance.settings import nats_url_problem

    urls = [url.strip() for url in nats.split(",") if url.strip()]
    if not urls:
        typer.echo(f"fleetbox: --nats: no NATS URL in {nats!r}; give one, e.g. {LOCAL_NATS}", err=True)
        raise typer.Exit(2)
    for url in urls:
        problem = nats_url_problem(url)
        if problem:
            typer.echo(f"fleetbox: --nats: {problem}", err=True)
            raise typer.Exit(2)
    return nats


def check_model_argument(model: str) -> str:
    """A verb's MODEL: empty, blank, or a name no model can have (a control character, too long) is a usage
    error; sent on, `models load ""` was asked of a box, which answered as if for a model it did not know."""
    return _check_name(model, "MODEL")


def _check_name(model: str, label: str) -> str:
    from appliance.settings import MODEL_NAME_MAX, MODEL_NAME_REFERENCE

    problem = None
    if not model.strip():
        problem = "names no model; give a model's name or alias, as `fleetbox models list` shows them"
    elif len(model) > MODEL_NAME_MAX:
        problem = f"is longer than {MODEL_NAME_MAX} characters, which no model's name is"
    elif not re.fullmatch(MODEL_NAME_REFERENCE, model):
        problem = "has a control character, which no model's name has"
    if problem:
        typer.echo(f"fleetbox: {label} {model!r} {problem}", err=True)
        raise typer.Exit(2)
    return model


def check_new_model_name(name: str) -> str:
    """A new model's NAME: beyond what any MODEL argument must be, the rule a box registers a name by (no space at
    either end, no invisible character); asked of a box, it answered with its schema's regular expression."""
    from tui.ops import new_name_problem

    if not name.strip():  # not MODEL's "give a model's name or alias, as `fleetbox models list` shows them" (h146)
        typer.echo(f"fleetbox: NAME {name!r} is empty; give the name the new model is to be called by", err=True)
        raise typer.Exit(2)
    _check_name(name, "NAME")
    problem = new_name_problem(name)
    if problem:
        typer.echo(f"fleetbox: NAME {name!r} {problem}", err=True)
        raise typer.Exit(2)
    return name


def check_box_id(box: str | None) -> str | None:
    """A box id given as an argument or `--box`: one no box can have (empty, a `.`) is a usage error, where
    `--box ""` was taken as no box given."""
    from appliance.settings import BOX_ID_PATTERN

    if box is not None and not re.fullmatch(BOX_ID_PATTERN, box):
        typer.echo(f"fleetbox: box id {box!r} is not 1 to 64 letters, digits, '-' or '_'", err=True)
        raise typer.Exit(2)
    return box


def one_of(option: str, allowed: tuple[str, ...]) -> Callable[[str | None], str | None]:
    """The check of an option with a few allowed values: anything else is a one-line usage error (exit 2)."""

    def check(value: str | None) -> str | None:
        if value is not None and value not in allowed:
            typer.echo(f"fleetbox: {option}: {value!r} is not one of {', '.join(allowed)}", err=True)
            raise typer.Exit(2)
        return value

    return check


def repeated_option(command: Any, args: list[str]) -> str | None:
    """What is wrong when an option of one value is given twice, a usage error (exit 2): click keeps the last one
    silently, so `fleetbox models load M --box a --box b` loaded on b, and `--pin --unpin` unpinned. Options given
    as lists (`--alias`) and plain flags said twice are fine. `command` is the app's click command
    (`typer.main.get_command`: typer carries a click of its own, so its classes are not `click`'s)."""
    for token in args:  # down to the (sub)command the arguments name
        subcommands = getattr(command, "commands", None)
        if not subcommands or token not in subcommands:
            break
        command = subcommands[token]
    names: dict[str, Any] = {}
    for param in command.params:
        if param.param_type_name == "option" and not param.multiple and not param.count:
            if not param.is_flag or param.secondary_opts:  # a plain flag said twice means the same
                names |= dict.fromkeys([*param.opts, *param.secondary_opts], param)
    said: dict[str, list[str]] = {}
    for token in args:
        if token == "--":
            break
        option = token.split("=", 1)[0]
        if option in names:
            said.setdefault(names[option].name, []).append(option)
    for given in said.values():
        if len(set(given)) > 1:
            return f"{' and '.join(dict.fromkeys(given))} given together; give one of them"
        if len(given) > 1:
            return f"{given[0]} given {len(given)} times; give it once"
    return None
