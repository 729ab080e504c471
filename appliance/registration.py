"""Registering a model: a folder judged before any request depends on it, then written to the catalog.

The folder must resolve (symlinks included) inside a configured model root (403 otherwise), its
task and adapter are detected from its files (422 when unsupported), and it must fit a box's
memory budget (507). `POST /v1/models` and the `register` control verb (the TUI, the CLI) both
come here, so a model is judged by one set of rules whichever way it is registered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
from nats.errors import Error as NatsError

from appliance.bus import model_slug
from appliance.catalog import (
    ADAPTER_SEPARATOR,
    Catalog,
    ModelSpec,
    batching_of,
    default_batching,
    knobs_given,
    slug_taken,
    spec_of,
)
from appliance.catalog_store import CatalogStore
from appliance.devices import HARDWARE_SLUG
from appliance.errors import Conflict, Forbidden, NotFound, ServiceUnavailable, Unprocessable, shown
from appliance.model_roots import PATH_ERRNOS, refuse_links_out, resolve_under_roots, unreadable
from appliance.profiles import PROFILE_AUTO, PROFILE_OFF
from appliance.schemas import ModelRegistration
from appliance.settings import MAX_ALIASES, Settings, composed_form_problem
from runtimes.adapter_check import (
    check_adapter_brings_head,
    check_adapter_fits,
    check_adapter_folder,
    check_adapter_labels,
)
from runtimes.base import RuntimeKind, Task, UnsupportedModel, shipped_onnx
from runtimes.config_check import ConfigNotJudged
from runtimes.detect import check_loadable, detect_task
from runtimes.options import option_problems

_registration = msgspec.json.Decoder(ModelRegistration)
_SEQUENCE_TASKS = {Task.SCORE, Task.CLASSIFY}
MODEL_VERBS = ("pin", "unpin", "load", "evict")  # POST /v1/models/{name}/{verb}: no model may be named so
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # what the catalog's JSON (orjson) writes


def _judge_folder(
    registration: ModelRegistration, roots: list[Path], base: ModelSpec | None
) -> tuple[Path, Task | None]:
    """The registration's folder and, for a model (`base` None; an adapter's base model otherwise), its task:
    file reads, so off the event loop. A path the file system will not follow is the client's to fix (422)."""
    try:
        return _judge_readable_folder(registration, roots, base)
    except OSError as exc:  # a name too long for `is_dir`, a file it may not read; not the box's own trouble (EIO)
        if exc.errno not in PATH_ERRNOS:
            raise
        raise unreadable(registration.path, exc) from None


def _judge_readable_folder(
    registration: ModelRegistration, roots: list[Path], base: ModelSpec | None
) -> tuple[Path, Task | None]:
    folder = resolve_under_roots(registration.path, roots)
    if not folder.is_dir():
        # A relative path is under the first root: say where it was looked for, and what is (not) there.
        where = "" if Path(registration.path).is_absolute() else f" (looked for at {folder}, under the first root)"
        what = "is not a folder" if folder.exists() else "does not exist"
        raise Unprocessable(f"path {registration.path!r} {what}{where}", code="path_not_found")
    shipped = shipped_onnx(folder, registration.options)
    if shipped is not None:  # a file the box will read, so inside a model root like the folder
        resolve_under_roots(str(shipped), roots)
    refuse_links_out(folder, roots, registration.path)
    if base is None:
        return folder, _task_for(registration, folder)
    try:
        check_adapter_folder(folder, base_task=base.task, mixed_rows=base.task is Task.GENERATE)
        heads = base.task in (Task.SCORE, Task.CLASSIFY, Task.EXTRACT)
        if heads:  # first: its words (labels) say more than a shape, and it needs no head in the base's weights
            check_adapter_labels(folder, base.path)
        check_adapter_fits(folder, base.path)
        if heads:
            check_adapter_brings_head(folder, base.path)
    except UnsupportedModel as exc:
        raise Unprocessable(str(exc), code="unsupported_adapter") from None
    return folder, None


def _task_for(registration: ModelRegistration, folder: Path) -> Task:
    """The folder's task, once it is known the folder can load."""
    try:
        detected = detect_task(folder)
    except UnsupportedModel as exc:
        raise Unprocessable(str(exc), code="unsupported_model") from None
    task = detected
    if registration.task is not None:
        asked = Task(registration.task)
        if not (asked is detected or {asked, detected} <= _SEQUENCE_TASKS):
            raise Unprocessable(f"the folder holds a model for {detected}, not {asked}", code="wrong_task")
        task = asked
    check_options(task, RuntimeKind(registration.runtime), registration.options)
    try:
        check_loadable(folder, task, RuntimeKind(registration.runtime), registration.options)
    except ConfigNotJudged as exc:  # this box could not judge it (a child process that timed out): not the folder
        raise ServiceUnavailable(str(exc), retry_after_s=10) from None
    except UnsupportedModel as exc:
        raise Unprocessable(str(exc), code="unsupported_model") from None
    return task


def _check_fields(registration: ModelRegistration, catalog: Catalog) -> None:
    """What the schema cannot say: aliases judged like names, integers the catalog's JSON can hold, a profile."""
    check_aliases(registration.name, registration.aliases, catalog)
    numbers = {field: getattr(registration, field) for field in ("max_batch_tokens", "max_batch_size")}
    numbers |= {f"options.{key}": value for key, value in registration.options.items()}
    check_integers(numbers)
    profile = registration.profile
    if profile not in (PROFILE_AUTO, PROFILE_OFF) and not HARDWARE_SLUG.fullmatch(profile):
        raise Unprocessable(
            f"invalid request: profile {profile!r} is not auto, off or a hardware slug "
            "(cpu-<cores>c, nvidia-<gpu>) - at `$.profile`"
        )


def _check_route_safe(name: str, what: str) -> None:
    """A name (or alias) that the model routes can tell apart: `GET /v1/models/{name}`, `.../{name}/pin`."""
    if (problem := composed_form_problem(name)) is not None:
        raise Unprocessable(f"{what} {name!r} {problem}", code="invalid_name")
    segments = name.split("/")
    if segments[-1] in MODEL_VERBS or any(segment in ("", ".", "..") for segment in segments):
        raise Unprocessable(
            f"{what} {name!r} would make its routes ambiguous: no empty, '.' or '..' segment between "
            f"slashes, and no last segment that is a verb ({', '.join(MODEL_VERBS)})",
            code="invalid_name",
        )


def check_aliases(name: str, aliases: list[str], catalog: Catalog | None = None) -> None:
    """A model's aliases, beyond each one's length and characters (the schema's `ModelName`): how many, not its
    own name, none twice, each one the routes can tell apart as a name (a registration's, and the new list of
    `PATCH /v1/models/{name}`), none a model's adapter address (`<model>:<x>`, the model itself included)."""
    if len(aliases) > MAX_ALIASES:
        raise Unprocessable(f"invalid request: at most {MAX_ALIASES} aliases, not {len(aliases)} - at `$.aliases`")
    for i, alias in enumerate(aliases):
        where = f"at `$.aliases[{i}]`"
        _check_route_safe(alias, "alias")
        owner = adapter_address_of(alias, catalog, also=name)
        if owner is not None:
            raise Unprocessable(
                f"invalid request: alias {alias!r} is the address of an adapter of {owner}; choose another - {where}",
                code="invalid_name",
            )
        if alias == name:
            raise Unprocessable(f"invalid request: alias {alias!r} is the model's own name - {where}")
        if alias in aliases[:i]:
            raise Unprocessable(f"invalid request: alias {alias!r} is given twice - {where}")


def adapter_address_of(name: str, catalog: Catalog | None, also: str | None = None) -> str | None:
    """The model whose adapter address `name` is (`<model>:<x>`, `<model>` registered, or `also`), or None."""
    return (catalog or Catalog()).adapter_address_owner(name, also)


def check_options(task: Task, runtime: RuntimeKind, options: dict[str, Any]) -> None:
    """422 for the first option a model of `task` on `runtime` cannot be run with (`runtimes.options`)."""
    for name, problem in option_problems(task, runtime, options, not_here=frozenset({"cache_dir"})).items():
        raise Unprocessable(f"invalid request: options.{name} {problem} - at `$.options.{name}`")


def check_integers(numbers: dict[str, Any]) -> None:
    """Integers the catalog's JSON (orjson: 64 bits) can hold, by their field's path."""
    for field, value in numbers.items():
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            raise Unprocessable(f"invalid request: integer out of range (64 bits at most) - at `$.{field}`")


async def refuse_taken(names: tuple[str, ...], catalog: Catalog, store: CatalogStore, owner: str | None = None) -> None:
    """409 for the first of `names` another model holds as its name or an alias (looked up in the bucket again,
    so a model just deleted on another box, or changed there to drop the alias, does not count); `owner`'s own
    names do not count."""
    for taken in names:
        holder = catalog.get(taken)
        if holder is None or holder.name == owner or not await store.still_holds(holder):
            continue
        holder = catalog.get(taken)  # the look again applied the model as the bucket has it now
        if holder is not None and holder.name != owner:
            held_as = "its name" if holder.name == taken else "an alias"
            raise Conflict(
                f"{taken!r} is taken: model {holder.name!r} has it as {held_as}; delete that model first",
                code="model_exists",
            )


def _refuse_unused_batching(registration: ModelRegistration, task: Task, base: ModelSpec | None) -> None:
    """Batching knobs that would be kept in the catalog and never used: an adapter runs in its base's batches,
    and a generator's decode batch comes from its options (they were taken silently)."""
    given = knobs_given(registration)
    if not given:
        return
    if base is not None:
        raise Unprocessable(
            f"an adapter runs in its base model's batches: {', '.join(given)} "
            f"{'belongs' if len(given) == 1 else 'belong'} to {base.name}",
        )
    if task is Task.GENERATE:
        raise Unprocessable(
            f"the folder holds a generator, whose decode batch is set by its options max_batch_size and "
            f"max_prefill_tokens: {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to it "
            "(give them in options)",
        )


def registration_from(payload: dict[str, Any]) -> ModelRegistration:
    """A registration that came as JSON already parsed (the `register` control verb), validated."""
    try:
        return msgspec.convert(payload, ModelRegistration)
    except msgspec.ValidationError as exc:
        raise Unprocessable(f"invalid request: {exc}") from None


async def register(
    registration: ModelRegistration,
    catalog: Catalog,
    store: CatalogStore,
    settings: Settings,
    check_fits: Callable[[ModelSpec], Awaitable[None]] | None,
    open_queue: Callable[[ModelSpec], Awaitable[None]] | None = None,
) -> ModelSpec:
    """Judge a registration and put it in the fleet's catalog: `POST /v1/models` and the `register` verb.
    `check_fits` refuses (507) a model no box could ever hold, pinned or not: the routes pass a
    `pin_fits.PinJudge`, which asks every box that runs models (a small box that took it refused a model the
    fleet's large boxes hold, and a gateway judged nothing: review h179)."""
    name = registration.name
    try:
        slug = model_slug(name)
    except ValueError as exc:
        raise Unprocessable(str(exc), code="invalid_name") from None
    _check_fields(registration, catalog)
    _check_route_safe(name, "model name")
    await refuse_taken((name, *registration.aliases), catalog, store)
    holder = catalog.by_slug(slug)
    if holder is not None and await store.still_holds(holder):
        # Named: the holder is listed under its own name ('k:l', 'RR'), so "an existing model's slug" named no one.
        raise Conflict(slug_taken(name, slug, holder.name), code="model_exists")
    if "cache_dir" in registration.options:  # a folder every box would write to: each box's own config says it
        raise Forbidden(
            "options.cache_dir is set in a box's config file, not through the API "
            "(exports are cached under each box's <state_dir>/onnx)",
            code="path_outside_model_roots",
        )
    if registration.runtime == "torch" and registration.dtype == "int8":
        raise Unprocessable("int8 needs the onnx runtime; torch runs float32, float16 or bfloat16", code="bad_dtype")
    base = None
    if registration.adapter_of is not None:
        base = catalog.get(registration.adapter_of)  # a name or an alias; the spec keeps the base's name
        if base is None:
            raise NotFound(f"base model {shown(registration.adapter_of)} does not exist", code="model_not_found")
        if registration.options:
            raise Unprocessable(
                f"invalid request: an adapter runs with its base's options (set them on {base.name}) - at `$.options`"
            )
        if base.adapter_of is not None:
            raise Unprocessable(
                f"{base.name} is an adapter of {base.adapter_of}; an adapter's base is a model: give adapter_of "
                f"{base.adapter_of!r}"
            )
        if registration.dtype not in ("float32", base.dtype):  # float32: the schema's default, i.e. left out
            raise Unprocessable(f"an adapter runs in its base model's dtype ({base.dtype}); leave dtype out")
        if registration.runtime != "torch":  # torch: the schema's default. Taken, it was listed and never used (h102)
            raise Unprocessable("an adapter runs on its base model's runtime (torch); leave runtime out")
        if registration.pinned:
            raise Unprocessable(f"an adapter is not pinned; pin its base model {base.name}")
        if base.runtime is not RuntimeKind.TORCH:
            raise Unprocessable(f"base model {base.name} runs on {base.runtime}; adapters need torch")
        if registration.task is not None and Task(registration.task) is not base.task:
            raise Unprocessable(
                f"an adapter serves its base model's task: {base.name} does {base.task}, not {registration.task}",
                code="wrong_task",
            )
        if ADAPTER_SEPARATOR in name and not name.startswith(base.name + ADAPTER_SEPARATOR):
            raise Unprocessable(f"an adapter named with ':' must be named {base.name}:<adapter>", code="invalid_name")
    elif (owner := adapter_address_of(name, catalog)) is not None:
        raise Unprocessable(
            f"{name!r} is the address of an adapter of {owner}: register it with adapter_of {owner!r}, "
            "or give the model a name of its own",
            code="invalid_name",
        )
    loop = asyncio.get_running_loop()
    folder, detected = await loop.run_in_executor(None, _judge_folder, registration, settings.roots, base)
    if base is not None:
        task, batching, adapter_of = base.task, base.batching, base.name
    else:
        assert detected is not None
        task, batching, adapter_of = detected, batching_of(registration, default_batching(settings)), None
    _refuse_unused_batching(registration, task, base)
    spec = replace(
        spec_of(registration, task=task, path=folder, batching=batching, adapter_of=adapter_of),
        registered_ms=time.time_ns() // 1_000_000,
    )
    if check_fits is not None and spec.adapter_of is None:
        await check_fits(spec)
    await store.create(spec)  # refused (409) when a registration racing this one took the slug, name or an alias
    if base is not None and not await store.still_holds(base):  # the base deleted on another box meanwhile
        await store.delete(spec)
        raise NotFound(f"base model {base.name} was deleted while its adapter was registered", code="model_not_found")
    if open_queue is not None and spec.adapter_of is None:
        try:
            await open_queue(spec)
        except NatsError as exc:  # the request stream holds no more consumers, say: a model nothing would serve
            await store.delete(spec)
            raise Conflict(
                f"model {name!r} was not registered: its queue could not be made ({exc}); "
                "delete models the fleet no longer serves",
                code="queue_refused",
            ) from None
    return spec
