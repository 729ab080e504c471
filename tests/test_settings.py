"""Settings precedence: flags over FBX_* environment over the TOML file over defaults."""

from __future__ import annotations

import pydantic
import pytest
from typer.testing import CliRunner

from appliance import cli
from appliance.catalog import DEFAULT_MODEL_NAME, Catalog
from appliance.settings import ModelEntry, Settings, load_settings, memory_budget_bytes


def test_precedence_flags_env_toml_defaults(tmp_path, monkeypatch) -> None:
    config = tmp_path / "box.toml"
    config.write_text('port = 9000\nmax_wait_ms = 7\nnats = "nats://a:4222,nats://b:4222"\n')
    monkeypatch.setenv("FBX_PORT", "9100")
    settings = load_settings(config)
    assert settings.port == 9100  # env beats the file
    assert settings.max_wait_ms == 7  # the file beats the default
    assert settings.nats_urls == ["nats://a:4222", "nats://b:4222"]
    assert settings.max_inputs == 2048 and settings.max_body_bytes == 8 * 1024 * 1024
    assert load_settings(config, port=1).port == 1  # a flag beats everything


def test_models_from_toml_join_the_default_model(tmp_path) -> None:
    config = tmp_path / "box.toml"
    config.write_text('[[models]]\nname = "fast"\nruntime = "noop"\nmax_batch_size = 8\n')
    catalog = Catalog.from_settings(load_settings(config))
    assert catalog.resolve("fast").spec.batching.max_batch_size == 8
    assert catalog.resolve("all-minilm-l6-v2").spec.name == DEFAULT_MODEL_NAME
    assert catalog.resolve(DEFAULT_MODEL_NAME).spec.pinned


def test_an_adapter_entry_may_name_its_base_by_an_alias(tmp_path) -> None:
    config = tmp_path / "box.toml"
    config.write_text(
        '[[models]]\nname = "base"\nruntime = "noop"\naliases = ["b"]\n'
        '[[models]]\nname = "base:tuned"\nruntime = "noop"\nadapter_of = "b"\n'
    )
    catalog = Catalog.from_settings(load_settings(config, default_model=False))
    assert catalog.get("base:tuned").adapter_of == "base"
    assert [spec.name for spec in catalog.adapters_of("base")] == ["base:tuned"]


def test_concurrent_batches_must_be_positive() -> None:
    assert ModelEntry(name="m", runtime="noop", concurrent_batches=2).concurrent_batches == 2
    for bad in (0, -1):
        with pytest.raises(pydantic.ValidationError):
            ModelEntry(name="m", runtime="noop", concurrent_batches=bad)
        with pytest.raises(pydantic.ValidationError):
            Settings(concurrent_batches=bad)


def test_memory_budget_forms() -> None:
    total = 1000
    assert memory_budget_bytes("6GB", total) == memory_budget_bytes("6G", total) == 6 * 10**9
    assert memory_budget_bytes("512MiB", total) == memory_budget_bytes("512mi", total) == 512 * 2**20
    assert memory_budget_bytes("123456", total) == 123456  # bytes
    assert memory_budget_bytes("0.5", total) == 500  # a share of the device's memory
    for bad in ("6X", "", "GB", "1.2.3", "-1", "6GiBs"):
        with pytest.raises(ValueError, match="not a size"):
            memory_budget_bytes(bad, total)


def test_bad_log_level_or_budget_is_a_settings_error() -> None:
    assert Settings(log_level="debug").log_level == "DEBUG"
    with pytest.raises(pydantic.ValidationError, match="log_level"):
        Settings(log_level="LOUD")
    with pytest.raises(pydantic.ValidationError, match="memory budget"):
        Settings(memory_budget="6X")


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--memory-budget", "6X"], {}),
        (["--log-level", "LOUD"], {}),
        (["--port", "70000"], {}),
        (["--device", "tpu"], {}),
        (["--replicas", "0"], {}),
        ([], {"FBX_MAX_INPUTS": "-1"}),
        ([], {"FBX_MAX_WAIT_MS": "60000"}),
        ([], {"FBX_MODELS": '[{"name": "x"}]'}),  # a model needs a folder
        ([], {"FBX_MODELS": '[{"name": "x", "path": "/nonexistent/folder"}]'}),
        ([], {"FBX_MODELS": '[{"name": "x", "runtime": "tensorrt"}]'}),
    ],
)
def test_serve_refuses_bad_settings_with_exit_2(args: list[str], env: dict[str, str], tmp_path, monkeypatch) -> None:
    """Stopped before anything starts, with the usage-error exit code and no traceback."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert "fleetbox: bad settings:" in result.output
    assert "Traceback" not in result.output
