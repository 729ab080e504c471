"""Every setting of a box, in one place: defaults < TOML file (`--config`) < `FBX_*` env < CLI flags.

Settings are plain values resolved once at start; nothing reads the environment after that.
Models come from `[[models]]` tables of the same TOML file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

Role = Literal["all", "gateway", "worker"]


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def memory_budget_bytes(raw: str, total: int) -> int:
    """A memory budget in bytes: `"6GB"` or `"6G"` (decimal), `"512MiB"` or `"512Mi"` (binary), `"123456"`
    (bytes), or a plain number up to 1 (`"0.5"`) as a share of `total`."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmg]i?)?(b?)", raw.strip().lower())
    if not match:
        raise ValueError(f"memory budget {raw!r} is not a size like 6GB, 512MiB or a share like 0.5")
    number, unit = float(match.group(1)), match.group(2) or ""
    if not unit and not match.group(3) and number <= 1.0:
        return int(total * number)
    return int(number * _SIZE_UNITS[unit])


class ModelEntry(BaseModel):
    """One `[[models]]` table: a model the box should know at start."""

    name: str
    path: Path | None = None  # a folder; None for the packaged default model
    task: str | None = None
    runtime: str = "torch"
    aliases: list[str] = Field(default_factory=list)
    pinned: bool = False
    dtype: str = "float32"
    options: dict[str, Any] = Field(default_factory=dict)
    adapter_of: str | None = None  # the base model's name, for a LoRA adapter
    max_batch_tokens: int | None = None
    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    concurrent_batches: int | None = Field(default=None, ge=1)
    profile: str = "auto"  # tuning profile: "auto" (this hardware's, or the nearest), "off", or a hardware slug


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FBX_", extra="ignore")

    # HTTP gateway
    host: str = "127.0.0.1"
    port: int = 8080
    role: Role = "all"
    max_body_bytes: int = 8 * 1024 * 1024
    max_inputs: int = 2048
    default_timeout_s: float = 30.0
    max_timeout_s: float = 300.0
    max_waiting: int = 8192  # requests one gateway awaits at once; past it, 429
    max_queue_s: float = 10.0  # 429 when a request would wait longer than this for its model (Little's law)

    # NATS
    nats: str | None = None  # comma-separated URLs; None starts the embedded server
    nats_port: int = 4222
    nats_host: str = "127.0.0.1"
    creds: Path | None = None  # NATS credentials (JWT + nkey) file
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    state_dir: Path = Path(".fleetbox")
    box_id: str | None = None

    # Durability: file storage and replicas for the stream and buckets (a NATS cluster of >= replicas)
    durable: bool = False
    replicas: int = 1
    blob_threshold: int = 512 * 1024  # bodies above this travel in the object store fbx_blobs

    # Stream FBX_REQ bounds (discard-new: a full queue is an immediate 429)
    stream_max_msgs: int = 100_000
    stream_max_bytes: int = 1024 * 1024 * 1024
    stream_max_age_s: float = 600.0
    # Consumer req_<slug>
    ack_wait_s: float = 10.0  # a dead box's requests come back after this: well inside default_timeout_s
    max_deliver: int = 5
    max_ack_pending: int = 10_000

    # Worker and batcher defaults (a profile or a model entry overrides them)
    max_batch_tokens: int = 16_384
    max_batch_size: int = 256
    max_wait_ms: float = 0.0  # how long an idle device waits for company; 0: start at once
    concurrent_batches: int = Field(default=1, ge=1)  # batches of one model on the device at once
    worker_capacity: int = 1024  # at most this many requests held per model (pulled, not yet acked)
    hold_ms: float = 150.0  # a box pulls only what it expects to answer within this (DESIGN: pull rule)
    device: str = "auto"
    threads: int | None = None
    profiles_dir: Path | None = None  # tuning profiles looked up before the shipped profiles/ (docs/tuning.md)

    # Catalog and residency
    default_model: bool = True
    models: list[ModelEntry] = Field(default_factory=list)
    model_roots: list[Path] = Field(default_factory=list)  # empty: <state_dir>/models
    memory_budget: str | None = None  # bytes ("6GB", "512MiB", "0.5" = share of memory); None: 90% GPU, 50% RAM
    cold_backlog: int = 32  # a box loads a model another box holds once this many requests wait for it

    # Fleet
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 5.0

    # Security: comma-separated keys; none set means the routes are open
    api_keys: str | None = None
    admin_keys: str | None = None
    max_concurrent_per_key: int = 0  # requests one API key may have in flight at once; 0: no limit
    metrics_require_key: bool = False  # protect /metrics with an API (or admin) key

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    shutdown_grace_s: float = 8.0  # how long a stopping box lets generations finish; keep SIGTERM-to-exit < 15 s

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_upper(cls, value: object) -> object:
        return value.strip().upper() if isinstance(value, str) else value

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
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

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
    def admin_key_list(self) -> list[str]:
        return _keys(self.admin_keys)

    @property
    def serves_http(self) -> bool:
        return self.role in ("all", "gateway")

    @property
    def runs_models(self) -> bool:
        return self.role in ("all", "worker")


def _keys(raw: str | None) -> list[str]:
    return [key.strip() for key in (raw or "").split(",") if key.strip()]


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Resolve settings; `overrides` are the CLI flags the user actually gave (None = not given)."""
    config_file = config_file or (Path(os.environ["FBX_CONFIG"]) if os.environ.get("FBX_CONFIG") else None)
    settings_cls: type[Settings] = Settings
    if config_file is not None:
        if not config_file.is_file():
            raise FileNotFoundError(f"config file {config_file} does not exist")
        config = SettingsConfigDict(**{**Settings.model_config, "toml_file": config_file})
        settings_cls = type("Settings", (Settings,), {"model_config": config})
    return settings_cls(**{k: v for k, v in overrides.items() if v is not None})
