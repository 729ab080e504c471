"""Every setting of a box, in one place: defaults < TOML file (`--config`) < `FBX_*` env < CLI flags.

Settings are plain values resolved once at start (settings_load.py); nothing reads the environment after that.
Models come from `[[models]]` tables of the same TOML file.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from appliance.devices import HARDWARE_SLUG

Role = Literal["all", "gateway", "worker"]
MODEL_ROLES: tuple[Role, ...] = ("all", "worker")  # the roles that run models
GATEWAY_ROLES: tuple[Role, ...] = ("all", "gateway")  # the roles that answer HTTP
Dtype = Literal["float32", "float16", "bfloat16", "int8"]


BOX_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# A model's name or alias: what clients send as `model`, shown in logs, headers and the TUI, so no control
# characters, no invisible or direction-changing ones (a name shown reversed by U+202E), and no space at either end.
_HIDDEN = r"\x00-\x1f\x7f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
MODEL_NAME_PATTERN = rf"^[^\s{_HIDDEN}](?:[^{_HIDDEN}]*[^\s{_HIDDEN}])?$"
# What the pattern means, said where a name is refused (pydantic and msgspec quote the pattern itself).
MODEL_NAME_RULE = (
    "a model's name or alias may hold no control, invisible or direction-changing characters, nor begin or end with "
    "a space"
)
# What a name given to address a model may hold: any name registered before the pattern above was (no control
# characters), so an older model can still be named to delete or change it.
MODEL_NAME_REFERENCE = r"[^\x00-\x1f\x7f]+"
MODEL_NAME_MAX = 200
MAX_ALIASES = 64
MAX_CONCURRENT_BATCHES = 64
# A batch's bounds: past them a value is a slip (a PATCH of max_batch_tokens 10**18 was taken, h84), and admission's
# rounds of batches, counted from them, would let any burst in.
MAX_BATCH_TOKENS = 1 << 22
MAX_BATCH_SIZE = 1 << 16
MAX_WAIT_MS = 1000.0  # a batch's wait for company past a second only ever delays it: the bound on max_wait_ms
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_url_problem(url: str) -> str | None:
    """Why one `--nats` URL cannot name a NATS server (a scheme nats-py does not speak, no host, a port out of
    range), or None: said in one line before connecting, where nats-py fails with a traceback or "host not found"."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if parts.scheme not in NATS_SCHEMES:
        return f"{url!r} is not a NATS URL: its scheme is {parts.scheme!r}, not one of {', '.join(NATS_SCHEMES)}"
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname:
        return f"{url!r} names no host"
    if port is not None and not 1 <= port <= 65535:
        return f"{url!r} has a port outside 1 to 65535"
    return None


_BUDGET_FORMS = "a share of the memory up to 1 such as 0.5, or a size with its unit such as 8GiB, 512MiB or 1000B"


def memory_budget_bytes(raw: str, total: int) -> int:
    """A memory budget in bytes. A plain number is a share of `total`, in (0, 1] (`"0.5"`, `"1"`); a size carries
    its unit: `"6GB"` or `"6G"` (decimal), `"512MiB"` or `"512Mi"` (binary), `"1000B"` (bytes). A plain number
    over 1 is refused: `2` read as 2 bytes while `1` means all of the memory, where the operator meant 2 GiB."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmg]i?)?(b?)", raw.strip().lower())
    if not match:
        raise ValueError(f"memory budget {raw!r} is not {_BUDGET_FORMS}")
    number, unit = float(match.group(1)), match.group(2) or ""
    if number == 0:
        raise ValueError(f"memory budget {raw!r} holds no model; give {_BUDGET_FORMS}")
    if not unit and not match.group(3):
        if number > 1.0:
            raise ValueError(f"memory budget {raw!r} is a plain number over 1; give {_BUDGET_FORMS}")
        return int(total * number)
    nbytes = int(number * _SIZE_UNITS[unit])
    if nbytes == 0:  # "0.5B"
        raise ValueError(f"memory budget {raw!r} is under one byte and holds no model; give {_BUDGET_FORMS}")
    return nbytes


ModelName = Annotated[str, Field(min_length=1, max_length=MODEL_NAME_MAX, pattern=MODEL_NAME_PATTERN)]


def composed_form_problem(name: str) -> str | None:
    """Why a new model name or alias is refused for how its characters are encoded, or None: it must be in Unicode's
    composed form (NFC), the form a name not found as sent is looked up in (tester h189: `café` composed and
    decomposed were two models that print alike)."""
    composed = unicodedata.normalize("NFC", name)
    return None if composed == name else f"is not in Unicode's composed form (NFC); write {composed!r}"


class ModelEntry(BaseModel):
    """One `[[models]]` table: a model the box should know at start, judged as `POST /v1/models` judges its
    fields (a typo here is a settings error at start, not a load that fails later)."""

    model_config = ConfigDict(extra="forbid")  # `pined = true` was dropped in silence and the model not pinned

    name: ModelName
    path: Path | None = None  # a folder; None only for the no-op runtime
    task: Literal["embed", "score", "classify", "extract", "generate"] | None = None
    runtime: Literal["torch", "onnx", "noop"] = "torch"
    aliases: list[ModelName] = Field(default_factory=list, max_length=MAX_ALIASES)
    pinned: bool = False
    dtype: Dtype = "float32"
    options: dict[str, Any] = Field(default_factory=dict)
    adapter_of: str | None = None  # the base model's name, for a LoRA adapter
    max_batch_tokens: int | None = Field(default=None, ge=1, le=MAX_BATCH_TOKENS)
    max_batch_size: int | None = Field(default=None, ge=1, le=MAX_BATCH_SIZE)
    max_wait_ms: float | None = Field(default=None, ge=0, le=MAX_WAIT_MS)
    concurrent_batches: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_BATCHES)
    profile: str = "auto"  # tuning profile: "auto" (this hardware's, or the nearest), "off", or a hardware slug

    @model_validator(mode="after")
    def _is_whole(self) -> ModelEntry:
        for name in (self.name, *self.aliases):
            if (problem := composed_form_problem(name)) is not None:
                raise ValueError(f"model name or alias {name!r} {problem}")
        if self.path is None and self.runtime != "noop":
            raise ValueError(f"model {self.name!r} needs a path (only the no-op runtime runs without a folder)")
        if self.runtime == "torch" and self.dtype == "int8":
            raise ValueError(
                f'model {self.name!r}: int8 needs runtime = "onnx"; torch runs float32, float16 or bfloat16'
            )
        if self.profile not in ("auto", "off") and not HARDWARE_SLUG.fullmatch(self.profile):
            raise ValueError(
                f"model {self.name!r}: profile {self.profile!r} is not auto, off or a hardware slug (cpu-<cores>c, "
                "nvidia-<gpu>)"
            )
        return self


MAX_NATS_SECONDS = 365 * 24 * 3600.0  # a year: NATS durations are int64 nanoseconds (292 years), and more is no setting
MAX_COUNT = 2**53  # NATS counts and sizes are int64; JSON numbers stay exact up to here
MAX_DELIVER = 1000  # deliveries of one request: past a handful, a failing request is poison, not bad luck
MAX_ACK_PENDING = 1_000_000


class Settings(BaseSettings):
    # inf and nan are no time, size or rate: `FBX_DEFAULT_TIMEOUT_S=inf` was accepted (and only capped later)
    model_config = SettingsConfigDict(env_prefix="FBX_", extra="forbid", allow_inf_nan=False)
    config_file_values: ClassVar[dict[str, Any]] = {}  # the `--config` file's tables, read once (load_settings)

    # HTTP gateway
    host: str = Field(default="127.0.0.1", min_length=1)  # empty would listen on every interface
    port: int = Field(default=8080, ge=0, le=65535)  # 0: any free port
    role: Role = "all"
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # Request bodies are held in memory while they arrive: the time one may take, and the bytes the box receives at
    # once (stalled uploads held 16 MB each for as long as their clients liked).
    body_timeout_s: float = Field(default=30.0, gt=0)
    max_receiving_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    max_inputs: int = Field(default=2048, ge=1)
    default_timeout_s: float = Field(default=30.0, gt=0)
    # A generation's deadline covers its whole answer: 30 s cut a 1,000-token answer on a CPU mid-stream.
    generation_timeout_s: float = Field(default=300.0, gt=0)
    max_timeout_s: float = Field(default=300.0, gt=0)
    max_waiting: int = Field(default=8192, ge=1)  # requests one gateway awaits at once; past it, 429
    max_queue_s: float = Field(default=10.0, gt=0)  # 429 when a request would wait longer than this for its model

    # NATS
    nats: str | None = None  # comma-separated URLs; None starts the embedded server
    nats_port: int = Field(default=4222, ge=1, le=65535)  # a real port: the box connects to it (no 0 here)
    nats_host: str = Field(default="127.0.0.1", min_length=1)  # empty: every interface, and no address to dial
    creds: Path | None = None  # NATS credentials (JWT + nkey) file
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    state_dir: Path = Path(".fleetbox")
    # one NATS subject token (fbx.ctl.<box>.<verb>): no dots, spaces or wildcards
    box_id: str | None = Field(default=None, pattern=BOX_ID_PATTERN)

    # Durability: file storage and replicas for the stream and buckets (a NATS cluster of >= replicas)
    durable: bool = False
    replicas: int = Field(default=1, ge=1, le=5)  # JetStream keeps at most 5 copies
    blob_threshold: int = Field(default=512 * 1024, ge=1)  # bodies above this travel in the object store fbx_blobs

    # Stream FBX_REQ bounds (discard-new: a full queue is an immediate 429)
    # Upper bounds are what NATS takes (int64 counts, durations in int64 nanoseconds) with sane room: a value past
    # them passed here and every model's queue was refused by the server (tester h73).
    stream_max_msgs: int = Field(default=100_000, ge=1, le=MAX_COUNT)
    stream_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1, le=MAX_COUNT)
    stream_max_age_s: float = Field(default=600.0, gt=0, le=MAX_NATS_SECONDS)
    # Consumer req_<slug>
    ack_wait_s: float = Field(default=10.0, gt=0, le=MAX_NATS_SECONDS)  # a dead box's requests come back after this
    max_deliver: int = Field(default=5, ge=1, le=MAX_DELIVER)
    max_ack_pending: int = Field(default=10_000, ge=1, le=MAX_ACK_PENDING)

    # Worker and batcher defaults (a profile or a model entry overrides them)
    max_batch_tokens: int = Field(default=16_384, ge=1, le=MAX_BATCH_TOKENS)
    max_batch_size: int = Field(default=256, ge=1, le=MAX_BATCH_SIZE)
    max_wait_ms: float = Field(default=0.0, ge=0, le=MAX_WAIT_MS)  # how long an idle device waits for company
    # batches of one model on the device at once; bounded as a model's own `concurrent_batches` is
    concurrent_batches: int = Field(default=1, ge=1, le=MAX_CONCURRENT_BATCHES)
    worker_capacity: int = Field(default=1024, ge=1)  # at most this many requests held per model (pulled, not acked)
    hold_ms: float = Field(default=150.0, gt=0)  # a box pulls only what it expects to answer within this (pull rule)
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    threads: int | None = Field(default=None, ge=1)
    profiles_dir: Path | None = None  # tuning profiles looked up before the shipped profiles/ (docs/tuning.md)

    # Catalog and residency
    default_model: bool = True
    models: list[ModelEntry] = Field(default_factory=list)
    # empty: <state_dir>/models; FBX_MODEL_ROOTS is a JSON list or comma-separated folders
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # a share of the memory ("0.5") or a size with its unit ("6GB", "512MiB", "1000B"); None: 90% GPU, 50% RAM
    memory_budget: str | None = None
    # a box loads a model another box holds once this many requests wait for it
    cold_backlog: int = Field(default=32, ge=1)

    # Fleet
    heartbeat_s: float = Field(default=1.0, gt=0, le=MAX_NATS_SECONDS)
    heartbeat_ttl_s: float = Field(default=5.0, gt=0, le=MAX_NATS_SECONDS)

    # Security: comma-separated keys; none set means the routes are open
    api_keys: str | None = None
    admin_keys: str | None = None
    max_concurrent_per_key: int = Field(default=0, ge=0)  # requests one API key may have in flight at once; 0: no limit
    metrics_require_key: bool = False  # protect /metrics with an API (or admin) key
    # Browser origins that may call the API (CORS), comma-separated, or "*"; none set: no CORS headers
    cors_allow_origins: str | None = None

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # how long a stopping box lets generations finish; keep SIGTERM-to-exit < 15 s
    shutdown_grace_s: float = Field(default=8.0, ge=0)

    @model_validator(mode="after")
    def _one_body_fits_the_receiving_bytes(self) -> Settings:
        if self.max_receiving_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_receiving_bytes ({self.max_receiving_bytes}) is less than max_body_bytes "
                f"({self.max_body_bytes}): a body of the largest size could never be received"
            )
        return self

    @model_validator(mode="after")
    def _a_heartbeat_outlives_its_interval(self) -> Settings:
        # A record that expires before the next one is written comes and goes: the fleet view flickered, boxes and
        # holders seen gone between beats (tester h199). Two beats a TTL leave room for one late write.
        if self.heartbeat_ttl_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s:g}) is less than twice heartbeat_s ({self.heartbeat_s:g}): a "
                "box's record would expire between its beats, and the fleet would see it come and go"
            )
        return self

    @model_validator(mode="after")
    def _metrics_key_needs_a_key(self) -> Settings:
        # With no key of either kind, `/metrics` stayed open: the operator asked for a protection that was not there.
        if self.metrics_require_key and not (self.api_key_list or self.admin_key_list):
            raise ValueError(
                "metrics_require_key is true, but no API or admin key is set (api_keys, admin_keys): /metrics "
                "would be open; set a key, or leave metrics_require_key false"
            )
        return self

    @field_validator("state_dir", "creds", "tls_ca", "tls_cert", "tls_key", "profiles_dir", mode="before")
    @classmethod
    def _paths_not_blank(cls, value: object) -> object:
        # Path("") is the working directory: `FBX_STATE_DIR=` (an unset variable in a compose file) put the store there
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty; give a path")
        return value

    @field_validator("model_roots", mode="before")
    @classmethod
    def _roots_from_text(cls, value: object) -> object:
        if isinstance(value, list) and any(isinstance(root, str) and not root.strip() for root in value):
            raise ValueError("a model root is empty; give a path")  # Path("") is the working directory
        if not isinstance(value, str):
            return value
        if value.strip().startswith("["):
            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]

    @field_validator("models")
    @classmethod
    def _models_distinct(cls, models: list[ModelEntry]) -> list[ModelEntry]:
        """Names and aliases are one namespace, and slugs name queues: as `POST /v1/models` refuses a collision
        (409), so does the config file (one entry silently shadowed another, and outlived its deletion)."""
        from appliance.bus import model_slug

        taken: dict[str, str] = {}  # name or alias -> the model that has it
        slugs: dict[str, str] = {}
        for entry in models:
            for name in (entry.name, *entry.aliases):
                if name in taken:
                    raise ValueError(
                        f"{name!r} is given twice, to models {taken[name]!r} and {entry.name!r} (names and aliases "
                        "are one namespace)"
                    )
                taken[name] = entry.name
            slug = model_slug(entry.name)
            if slug in slugs:
                raise ValueError(f"models {slugs[slug]!r} and {entry.name!r} have one slug, {slug!r}")
            slugs[slug] = entry.name
        return models

    @field_validator("nats")
    @classmethod
    def _nats_urls(cls, value: str | None) -> str | None:
        for url in (value or "").split(","):
            problem = nats_url_problem(url.strip()) if url.strip() else None
            if problem:
                raise ValueError(problem)
        return value

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins_are_origins(cls, value: str | None) -> str | None:
        """An origin is `scheme://host[:port]` as a browser sends it (no path, no trailing `/`; an IPv6 host in
        brackets), or `*`: one written otherwise would never match, and the browser's refusal would not say why.
        Compared without case (`cors_origin_list`); a default port (`:443` on https) is one a browser leaves out."""
        origin_pattern = r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[^/\s:\[\]]+)(:[0-9]{1,5})?"
        for origin in _keys(value):
            if origin != "*" and not re.fullmatch(origin_pattern, origin, flags=re.IGNORECASE):
                raise ValueError(f"{origin!r} is not an origin: give scheme://host[:port] (no path), or *")
            if re.search(r"^https://.*:443$|^http://.*:80$", origin, flags=re.IGNORECASE):
                raise ValueError(f"{origin!r} names its scheme's default port, which browsers leave out: drop it")
        return value

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _keys_given_are_keys(cls, value: str | None) -> str | None:
        """A keys setting given as text holds keys, every member one: `","`, `""` or `"k1,,k2"` most often come
        from a template whose variables were empty (`"${K1},${K2}"`). Read as "no key", the first two left every
        route open, admin included; dropping the empty member of the third would hide the key that is missing."""
        if value is None:
            return None
        members = [member.strip() for member in value.split(",")]
        if not any(members):
            raise ValueError(
                "set but holds no key (empty, or only commas and spaces); unset it to leave the routes open"
            )
        if not all(members):
            empty = members.index("") + 1
            raise ValueError(f"key {empty} of {len(members)} is empty; fill in the missing key or drop the extra comma")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_upper(cls, value: object) -> object:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget_number_as_text(cls, value: object) -> object:
        """`memory_budget = 0.5` in the TOML file is a number, judged as the text `"0.5"` is."""
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value

    @field_validator("memory_budget")
    @classmethod
    def _budget_form(cls, value: str | None) -> str | None:
        if value is not None:
            memory_budget_bytes(value, total=1)  # checks the form only; the device's memory is read at start
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags beat the environment, which beats the TOML file, which beats the defaults.
        file_values = InitSettingsSource(settings_cls, init_kwargs=cls.config_file_values)
        return (init_settings, env_settings, file_values)

    @property
    def nats_urls(self) -> list[str]:
        return [url.strip() for url in (self.nats or "").split(",") if url.strip()]

    @property
    def roots(self) -> list[Path]:
        """Where registered model folders may live, resolved (symlinks included)."""
        return [root.resolve() for root in (self.model_roots or [self.state_dir / "models"])]

    @property
    def api_key_list(self) -> list[str]:
        return _keys(self.api_keys)

    @property
    def cors_origin_list(self) -> list[str]:
        return [origin.lower() for origin in _keys(self.cors_allow_origins)]

    @property
    def admin_key_list(self) -> list[str]:
        return _keys(self.admin_keys)

    @property
    def serves_http(self) -> bool:
        return self.role in GATEWAY_ROLES

    @property
    def runs_models(self) -> bool:
        return self.role in MODEL_ROLES


def _keys(raw: str | None) -> list[str]:
    return [key.strip() for key in (raw or "").split(",") if key.strip()]
