"""Settings precedence: flags over FBX_* environment over the TOML file over defaults."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pydantic
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from appliance import cli
from appliance.app import new_box_id
from appliance.catalog import DEFAULT_MODEL_NAME, Catalog
from appliance.configured import configured_specs
from appliance.natsd import free_port
from appliance.settings import MAX_CONCURRENT_BATCHES, MODEL_NAME_RULE, ModelEntry, Settings, memory_budget_bytes
from appliance.settings_load import load_settings, unknown_variables


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
    catalog = Catalog(configured_specs(load_settings(config)))
    assert catalog.resolve("fast").spec.batching.max_batch_size == 8
    assert catalog.resolve("all-minilm-l6-v2").spec.name == DEFAULT_MODEL_NAME
    assert catalog.resolve(DEFAULT_MODEL_NAME).spec.pinned


def test_an_adapter_entry_may_name_its_base_by_an_alias_and_serves_its_task(tmp_path) -> None:
    """Kept under its base's name and listed with its base's task, as an adapter registered through the API."""
    config = tmp_path / "box.toml"
    config.write_text(
        '[[models]]\nname = "base"\nruntime = "noop"\naliases = ["b"]\ntask = "classify"\n'
        '[[models]]\nname = "base:tuned"\nruntime = "noop"\nadapter_of = "b"\n'
    )
    catalog = Catalog(configured_specs(load_settings(config, default_model=False)))
    assert catalog.get("base:tuned").adapter_of == "base"
    assert catalog.get("base:tuned").task.value == "classify"
    assert [spec.name for spec in catalog.adapters_of("base")] == ["base:tuned"]


@pytest.mark.parametrize(
    ("entries", "refusal"),
    [
        ('name = "gen"\nruntime = "noop"\ntask = "generate"\nmax_batch_size = 8\n', "decode batch set by its options"),
        (
            'name = "base"\nruntime = "noop"\n[[models]]\nname = "base:a"\nruntime = "noop"\nadapter_of = "base"\n'
            "max_wait_ms = 3\n",
            "its base's batches",
        ),
    ],
    ids=["generator", "adapter"],
)
def test_batching_knobs_a_model_would_never_use_are_a_settings_error(tmp_path, entries: str, refusal: str) -> None:
    """As through the API: a generator's or an adapter's batching knobs were taken and never used."""
    config = tmp_path / "box.toml"
    config.write_text("[[models]]\n" + entries)
    with pytest.raises(ValueError, match=refusal):
        configured_specs(load_settings(config, default_model=False))


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ('{ max_batch_size = "lots" }', "options.max_batch_size must be a whole number"),
        ("{ max_batch_size = 0 }", "options.max_batch_size must be at least 1"),
        ("{ max_prefill_tokens = 1.5 }", "options.max_prefill_tokens must be a whole number"),
        ("{ max_batchsize = 4 }", "options.max_batchsize is not an option of a no-op model; its .*max_batch_size"),
    ],
)
def test_a_generators_options_are_judged_at_start(tmp_path, options: str, refusal: str) -> None:
    """A decode batch of "lots" was a 500 on every request, one of 0 a wait to every request's deadline."""
    config = tmp_path / "box.toml"
    config.write_text(f'[[models]]\nname = "gen"\nruntime = "noop"\ntask = "generate"\noptions = {options}\n')
    with pytest.raises(ValueError, match=f"models.0: model 'gen': {refusal}"):
        configured_specs(load_settings(config, default_model=False))


def test_concurrent_batches_must_be_positive() -> None:
    assert ModelEntry(name="m", runtime="noop", concurrent_batches=2).concurrent_batches == 2
    for bad in (0, -1):
        with pytest.raises(pydantic.ValidationError):
            ModelEntry(name="m", runtime="noop", concurrent_batches=bad)
        with pytest.raises(pydantic.ValidationError):
            Settings(concurrent_batches=bad)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"dtype": "fp16"}, "dtype"),  # a typo loaded as a KeyError in the torch backend, a load_error at best
        ({"dtype": "int8"}, "int8 needs runtime"),  # torch cannot run it
        ({"concurrent_batches": 65}, "concurrent_batches"),
        ({"profile": "cpu-16"}, "not auto, off or a hardware slug"),
        ({"aliases": [f"a{i}" for i in range(65)]}, "aliases"),
        ({"aliases": ["bad\nalias"]}, "aliases"),
    ],
)
def test_a_models_entry_is_judged_as_the_api_judges_a_registration(fields: dict, named: str, tmp_path) -> None:
    """`[[models]]` fields took any string or number: a typo registered, then failed at load (or never)."""
    with pytest.raises(pydantic.ValidationError, match=named):
        ModelEntry(name="m", path=tmp_path, **fields)
    good = {"dtype": "int8", "runtime": "onnx", "profile": "nvidia-l4", "concurrent_batches": 64}
    assert ModelEntry(name="m", path=tmp_path, **good).profile == "nvidia-l4"


def test_memory_budget_forms() -> None:
    total = 1000
    assert memory_budget_bytes("6GB", total) == memory_budget_bytes("6G", total) == 6 * 10**9
    assert memory_budget_bytes("512MiB", total) == memory_budget_bytes("512mi", total) == 512 * 2**20
    assert memory_budget_bytes("123456B", total) == memory_budget_bytes("123456 b", total) == 123456  # bytes
    assert memory_budget_bytes("0.5", total) == 500  # a share of the device's memory
    assert memory_budget_bytes("1", total) == memory_budget_bytes("1.0", total) == 1000
    for bad in ("6X", "", "GB", "1.2.3", "-1", "6GiBs"):
        with pytest.raises(ValueError, match="is not a share of the memory"):
            memory_budget_bytes(bad, total)
    # A budget of nothing, and 1.5 (read as 1.5 bytes while 1 means all of the memory), were taken.
    for bad, said in (("0", "holds no model"), ("0GB", "holds no model"), ("1.5", "plain number over 1")):
        with pytest.raises(ValueError, match=said):
            memory_budget_bytes(bad, total)


@pytest.mark.parametrize("bad", ["2", "16", "123456", "1.5"])
def test_a_plain_number_over_1_is_no_budget_it_needs_a_unit(bad: str) -> None:
    """`2` was read as 2 bytes while `1` means all of the memory: a size without its unit (2 GiB meant), refused
    with the forms that are taken, as is a share over 1."""
    with pytest.raises(ValueError, match=r"plain number over 1; give a share .* such as 0.5, or a size with its unit"):
        memory_budget_bytes(bad, 1000)


@pytest.mark.parametrize("bad", ["0.5B", "0.0001KB"])
def test_a_size_under_one_byte_is_no_budget(bad: str) -> None:
    """`0.5B` was a budget of 0 bytes (a box that holds no model), past the check for 0."""
    with pytest.raises(ValueError, match="under one byte"):
        memory_budget_bytes(bad, 1000)


@pytest.mark.parametrize("where", ["flag", "env", "toml"])
def test_serve_refuses_a_budget_of_2_from_flag_env_or_config_file(where: str, tmp_path, monkeypatch) -> None:
    args = ["serve", "--state-dir", str(tmp_path)]
    if where == "flag":
        args += ["--memory-budget", "2"]
    elif where == "env":
        monkeypatch.setenv("FBX_MEMORY_BUDGET", "2")
    else:
        (tmp_path / "box.toml").write_text("memory_budget = 2\n")
        args += ["--config", str(tmp_path / "box.toml")]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        "fleetbox: bad settings: memory_budget: memory budget '2' is a plain number over 1; give a share of the "
        "memory up to 1 such as 0.5, or a size with its unit such as 8GiB, 512MiB or 1000B"
    ]


def test_a_budget_in_the_config_file_may_be_a_toml_number_or_text(tmp_path) -> None:
    """`memory_budget = 0.5` (a TOML float) was refused as 'Input should be a valid string'."""
    for line, budget in (
        ("memory_budget = 0.5", "0.5"),
        ("memory_budget = 1", "1"),
        ('memory_budget = "8GiB"', "8GiB"),
    ):
        (tmp_path / "box.toml").write_text(line + "\n")
        assert load_settings(tmp_path / "box.toml").memory_budget == budget


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
        (["--nats-port", "0"], {}),  # the box would wait for a server on port 0, then fail
        ([], {"FBX_NATS_PORT": "0"}),
        ([], {"FBX_MAX_INPUTS": "-1"}),
        ([], {"FBX_MAX_WAIT_MS": "60000"}),
        ([], {"FBX_MODELS": '[{"name": "x"}]'}),  # a model needs a folder
        ([], {"FBX_MODELS": '[{"name": "x", "path": "/nonexistent/folder"}]'}),
        ([], {"FBX_MODELS": '[{"name": "x", "runtime": "tensorrt"}]'}),
        (["--nats", "nats://127.0.0.1:99999"], {}),  # nats-py failed the start with "invalid connect url option"
        (["--nats", "http://127.0.0.1:4222"], {}),
        (["--box-id", "a.b"], {}),  # a box id is one NATS subject token
        (["--box-id", "a b.c"], {}),
        (["--device", "cuda:64"], {}),  # more CUDA devices than any machine here has
        pytest.param(
            ["--device", "cuda"], {}, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
        ),
        (["--creds", "/nonexistent/user.creds"], {}),
        (["--host", "not a host"], {}),  # the box started NATS and loaded its models, then exited 1 (gaierror)
        ([], {"FBX_HOST": "not a host"}),
        ([], {"FBX_NATS_HOST": "not a host"}),  # the embedded server's bind address
        ([], {"FBX_CONCURRENT_BATCHES": "100"}),  # a model's own concurrent_batches is 1 to 64: so is the default
        ([], {"FBX_DEFAULT_TIMEOUT_S": "inf"}),  # accepted, then only capped by max_timeout_s
        ([], {"FBX_DEFAULT_TIMEOUT_S": "nan"}),
        ([], {"FBX_HEARTBEAT_TTL_S": "inf"}),
        ([], {"FBX_HEARTBEAT_TTL_S": "0.5"}),  # under two beats: the fleet saw the box come and go (tester h199)
        ([], {"FBX_HEARTBEAT_S": "3"}),
        # Past what NATS takes: the box started, /readyz ready, and every model's queue was refused (tester h73)
        ([], {"FBX_ACK_WAIT_S": "1e12"}),
        ([], {"FBX_MAX_DELIVER": "99999999999999999999"}),
        ([], {"FBX_MAX_ACK_PENDING": "99999999999999999999"}),
        ([], {"FBX_STREAM_MAX_AGE_S": "1e12"}),
        ([], {"FBX_STREAM_MAX_MSGS": "99999999999999999999"}),
        ([], {"FBX_HEARTBEAT_TTL_S": "1e12"}),
        ([], {"FBX_HOST": ""}),  # an unset variable in `-e FBX_HOST=$X`: the API listened on every interface
        ([], {"FBX_NATS_HOST": ""}),  # the embedded server on every interface, then 'did not listen' after 15 s
        ([], {"FBX_TLS_CA": ""}),
    ],
)
def test_serve_refuses_bad_settings_with_exit_2(args: list[str], env: dict[str, str], tmp_path, monkeypatch) -> None:
    """Stopped before anything starts, with the usage-error exit code and no traceback."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("fleetbox: bad settings:")
    assert len(result.output.splitlines()) == 1, result.output  # one line, no pydantic text or links
    assert "Traceback" not in result.output


def test_each_bad_setting_is_one_line_naming_the_field_and_the_value(tmp_path) -> None:
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--port", "70000", "--replicas", "0"])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "fleetbox: bad settings: port: Input should be less than or equal to 65535 (got 70000)",
        "fleetbox: bad settings: replicas: Input should be greater than or equal to 1 (got 0)",
    ]


def test_a_value_the_rule_names_too_is_still_shown(tmp_path, monkeypatch) -> None:
    """`Input should be greater than 0` holds a 0, so a 0 given was not shown (auditor h61)."""
    monkeypatch.setenv("FBX_DEFAULT_TIMEOUT_S", "0")
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path)])
    assert result.output == "fleetbox: bad settings: default_timeout_s: Input should be greater than 0 (got '0')\n"


def test_a_misspelt_key_of_the_config_file_is_refused_with_the_setting_it_is_near(tmp_path) -> None:
    config = tmp_path / "box.toml"
    config.write_text('max_body_byte = 5\n[[models]]\nname = "fast"\nruntime = "noop"\npined = true\n')
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--config", str(config)])
    assert result.exit_code == 2
    assert sorted(result.output.splitlines()) == [
        "fleetbox: bad settings: max_body_byte: not a setting (did you mean max_body_bytes?)",
        "fleetbox: bad settings: models.0.pined: not a setting (did you mean pinned?)",
    ]


def test_a_models_name_that_breaks_the_rule_is_refused_in_words_not_by_its_pattern(tmp_path) -> None:
    """Tester h199: a config file's name or alias with a space at its end (or an invisible character) was refused
    quoting the 100-character pattern, where the API says the rule."""
    config = tmp_path / "box.toml"
    config.write_text(
        '[[models]]\nname = " g"\nruntime = "noop"\n'
        '[[models]]\nname = "h"\nruntime = "noop"\naliases = ["ok", "bad "]\n'
    )
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--config", str(config)])
    assert result.exit_code == 2
    assert sorted(result.output.splitlines()) == [
        f"fleetbox: bad settings: models.0.name: {MODEL_NAME_RULE} (got ' g')",
        f"fleetbox: bad settings: models.1.aliases.1: {MODEL_NAME_RULE} (got 'bad ')",
    ]


def _piped(text: str) -> Path:
    """A config file as `--config <(...)` gives it: a pipe's path, which reads once."""
    read_end, write_end = os.pipe()
    os.write(write_end, text.encode())
    os.close(write_end)
    return Path(f"/dev/fd/{read_end}")


def test_a_config_file_may_be_a_pipe_and_is_read_once() -> None:
    """`--config <(...)` was refused as a file that "does not exist"; past that check, pydantic-settings' TOML
    source skips what is not a regular file, so a pipe's settings (its unknown keys too) were dropped in silence."""
    piped = _piped("port = 9123\n")
    try:
        assert load_settings(piped).port == 9123
    finally:
        os.close(int(piped.name))
    piped = _piped("port = 9123\nmax_body_byte = 5\n")
    try:
        result = CliRunner().invoke(cli.app, ["serve", "--config", str(piped)])
    finally:
        os.close(int(piped.name))
    assert result.exit_code == 2
    assert result.output == "fleetbox: bad settings: max_body_byte: not a setting (did you mean max_body_bytes?)\n"


def test_replicas_without_a_cluster_to_join_is_a_settings_error(tmp_path) -> None:
    """The embedded server is one server: its stream refused, the box exited 1 saying `ServerError()` (h61)."""
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--replicas", "3"])
    assert result.exit_code == 2
    assert result.output == (
        "fleetbox: bad settings: replicas: 3 needs a NATS cluster of at least that many servers; the embedded server "
        "is one: join a cluster with --nats, or leave replicas at 1\n"
    )
    assert Settings(replicas=3).replicas == 3  # judged by serve only: tune reads the same config file


def test_an_fbx_variable_that_is_no_setting_is_named_with_the_one_it_is_near() -> None:
    environ = {"FBX_MAX_BATCH_TOKEN": "512", "FBX_PORT": "1", "FBX_CONFIG": "box.toml", "FBX_ZZZZ": "1", "HOME": "/"}
    assert unknown_variables(environ) == [
        "FBX_MAX_BATCH_TOKEN is not a setting (did you mean FBX_MAX_BATCH_TOKENS?); ignored",
        "FBX_ZZZZ is not a setting; ignored",
    ]


def test_a_host_that_does_not_resolve_or_is_not_here_is_named_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FBX_NATS_HOST", "192.0.2.1")  # TEST-NET-1: no machine here has it
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--host", "not a host"])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert lines[0].startswith("fleetbox: bad settings: host: 'not a host' does not resolve to an address ("), lines
    assert lines[1].startswith("fleetbox: bad settings: nats_host: cannot listen on '192.0.2.1': "), lines
    assert len(lines) == 2, lines


def test_nats_host_is_not_checked_when_the_box_joins_a_server(tmp_path, monkeypatch) -> None:
    """With --nats no embedded server binds nats_host: only the other checks speak (here a bad port)."""
    monkeypatch.setenv("FBX_NATS_HOST", "not a host")
    result = CliRunner().invoke(
        cli.app, ["serve", "--state-dir", str(tmp_path), "--nats", "nats://127.0.0.1:4222", "--device", "cuda:64"]
    )
    assert result.exit_code == 2
    assert result.output.startswith("fleetbox: bad settings: device: cuda:64"), result.output
    assert "nats_host" not in result.output


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"FBX_API_KEYS": ","}, "api_keys: set but holds no key"),  # every route was open, admin included
        ({"FBX_ADMIN_KEYS": " , "}, "admin_keys: set but holds no key"),
        ({"FBX_ADMIN_KEYS": ""}, "admin_keys: set but holds no key"),  # -e FBX_ADMIN_KEYS="$UNSET_VARIABLE"
        ({"FBX_API_KEYS": "secret-1,,secret-2"}, "api_keys: key 2 of 3 is empty"),
        ({"FBX_ADMIN_KEYS": "secret-1, "}, "admin_keys: key 2 of 2 is empty"),
    ],
)
def test_a_keys_setting_given_with_no_key_or_an_empty_key_is_refused(env, problem, tmp_path, monkeypatch) -> None:
    """Not read as "no key" (routes open) nor with the empty member dropped (a key missing unnoticed); the
    refusal never prints the keys given."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.startswith(f"fleetbox: bad settings: {problem}"), result.output
    assert len(result.output.splitlines()) == 1
    assert "secret" not in result.output


def test_keys_are_comma_separated_and_trimmed() -> None:
    settings = Settings(api_keys="k1, k2", admin_keys=" a ")
    assert (settings.api_key_list, settings.admin_key_list) == (["k1", "k2"], ["a"])
    assert Settings().api_key_list == []  # unset: the routes are open


def test_no_time_or_rate_setting_takes_inf_or_nan() -> None:
    floats = [name for name, field in Settings.model_fields.items() if field.annotation in (float, float | None)]
    assert "default_timeout_s" in floats and "hold_ms" in floats
    for name in floats:
        for value in ("inf", "-inf", "nan"):
            with pytest.raises(pydantic.ValidationError, match=f"{name}\n  Input should be a finite number"):
                Settings(**{name: value})


def test_the_box_wide_concurrent_batches_is_bounded_as_a_models_own() -> None:
    assert Settings(concurrent_batches=MAX_CONCURRENT_BATCHES).concurrent_batches == 64
    with pytest.raises(pydantic.ValidationError, match="concurrent_batches"):
        Settings(concurrent_batches=MAX_CONCURRENT_BATCHES + 1)


def test_box_ids_are_one_subject_token_and_generated_ones_pass() -> None:
    for good in ("box-1", "tui_box", "A9", "x" * 64, new_box_id()):
        assert Settings(box_id=good).box_id == good
    for bad in ("a.b", "a b", "a*", ">", "", "x" * 65, "bö"):
        with pytest.raises(pydantic.ValidationError, match="box_id"):
            Settings(box_id=bad)


def test_tune_refuses_a_device_this_machine_lacks_before_anything_starts(tmp_path) -> None:
    result = CliRunner().invoke(cli.app, ["tune", str(tmp_path), "--device", "cuda:64", "--dry-run"])
    assert result.exit_code == 2
    assert result.output.startswith("fleetbox: bad settings: device: cuda:64: torch sees ")


def test_serve_names_a_port_in_use_in_one_line(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--state-dir", str(tmp_path), "--port", str(port), "--nats-port", str(free_port())]
        result = CliRunner().invoke(cli.app, args)  # another NATS port than 4222, which something may hold
    assert result.exit_code == 1
    assert result.output == f"fleetbox: port {port} on 127.0.0.1 is in use\n"


def test_model_roots_from_the_environment_as_a_list_or_comma_separated(monkeypatch) -> None:
    monkeypatch.setenv("FBX_MODEL_ROOTS", "/srv/a, /srv/b")
    assert [str(p) for p in load_settings(None).model_roots] == ["/srv/a", "/srv/b"]
    monkeypatch.setenv("FBX_MODEL_ROOTS", '["/srv/c"]')
    assert [str(p) for p in load_settings(None).model_roots] == ["/srv/c"]


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ([{"name": "a", "aliases": ["c"]}, {"name": "c"}], "'c' is given twice, to models 'a' and 'c'"),
        ([{"name": "a"}, {"name": "a"}], "'a' is given twice"),
        ([{"name": "Same"}, {"name": "same"}], "have one slug, 'same'"),
    ],
)
def test_models_in_the_config_file_may_not_share_a_name_alias_or_slug(models: list[dict], named: str) -> None:
    """The API refuses these (409); the config file took them, one entry shadowing another (a model named `c`
    beside another's alias `c` answered for `c` after `c` was deleted)."""
    with pytest.raises(pydantic.ValidationError, match=named):
        Settings(models=[{"runtime": "noop", **model} for model in models])


@pytest.mark.parametrize(
    ("toml", "env", "problem"),
    [
        ("port = [\n", {}, "config file {config}: Invalid value (at end of document)"),
        ("port = ]\n", {}, "config file {config}: Invalid value (at line 1, column 8)"),
        (None, {"FBX_MODELS": "not json"}, "FBX_MODELS: not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ],
    ids=["toml-at-end", "toml-at-line", "env-json"],
)
def test_a_config_file_or_variable_that_does_not_parse_is_named_with_the_place(
    toml: str | None, env: dict[str, str], problem: str, tmp_path, monkeypatch
) -> None:
    """tomllib's message named no file (`Invalid value (at end of document)`), and pydantic-settings' no variable
    and no place (`error parsing value for field "models" from source "EnvSettingsSource"`)."""
    config = tmp_path / "box.toml"
    args = ["serve", "--state-dir", str(tmp_path)]
    if toml is not None:
        config.write_text(toml)
        args += ["--config", str(config)]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2
    assert result.output == f"fleetbox: bad settings: {problem.format(config=config)}\n"


@pytest.mark.parametrize(
    ("toml", "env", "problem"),
    [
        ('[[models]]\nname = "g"\npath = "{absent}"\n', {}, "models.0: model 'g': {absent} does not exist"),
        (
            '[[models]]\nname = "a"\nruntime = "noop"\n[[models]]\nname = "g"\npath = "{config}"\n',
            {},
            "models.1: model 'g': {config} is not a folder",
        ),
        ('[[models]]\nname = "g"\npath = "{tmp}"\n', {}, "models.0: model 'g': {tmp} has no config.json"),
        ("", {"FBX_MODELS": '[{{"name": "m", "path": "{absent}"}}]'}, "models.0: model 'm': {absent} does not exist"),
    ],
    ids=["absent", "a-file", "not-a-model", "env"],
)
def test_a_models_entry_whose_folder_is_missing_is_named_with_its_place(
    toml: str, env: dict[str, str], problem: str, tmp_path, monkeypatch
) -> None:
    """As other `[[models]]` refusals are (`models.0: model 'g': ...`): a missing folder said only `/x has no
    config.json; a transformers model folder is expected`, naming neither the entry nor the folder's absence."""
    config = tmp_path / "box.toml"
    places = {"absent": tmp_path / "nothere", "config": config, "tmp": tmp_path}
    config.write_text(toml.format(**places))
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(**places))
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--config", str(config)])
    assert result.exit_code == 2
    assert result.output.startswith(f"fleetbox: bad settings: {problem.format(**places)}"), result.output
    assert len(result.output.splitlines()) == 1


def test_every_models_entry_that_cannot_be_served_is_said_at_once(tmp_path) -> None:
    """Only the first `[[models]]` entry whose folder was missing was said: an operator fixed one a start (h104)."""
    config = tmp_path / "box.toml"
    config.write_text(
        f'default_model = false\n[[models]]\nname = "a"\npath = "{tmp_path / "a"}"\n'
        f'[[models]]\nname = "b"\npath = "{tmp_path / "b"}"\n'
    )
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--config", str(config)])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    said = [line.removeprefix("fleetbox: bad settings: ").split(":")[0] for line in lines]
    assert said == ["models.0", "models.1"], result.output
    assert all(line.startswith("fleetbox: bad settings: models.") for line in lines), result.output


@pytest.mark.parametrize(
    ("origins", "why"),
    [
        ("https://app.example.com/", "is not an origin"),
        ("app.example.com", "is not an origin"),
        ("https://a.com/path", "is not an origin"),
        ("*,https://a b", "is not an origin"),
        ("https://a.com:443", "default port"),
    ],
)
def test_a_cors_origin_written_otherwise_than_a_browser_sends_it_is_refused(origins: str, why: str) -> None:
    """It would never match an `Origin` header, and the browser's refusal would not say why."""
    with pytest.raises(pydantic.ValidationError, match=why):
        Settings(cors_allow_origins=origins)
    given = "HTTPS://App.Example.com, http://localhost:3000, http://[::1]:8000, chrome-extension://abc"
    assert Settings(cors_allow_origins=given).cors_origin_list == [
        "https://app.example.com",  # as a browser sends it: lower case
        "http://localhost:3000",
        "http://[::1]:8000",
        "chrome-extension://abc",
    ]


def test_a_blank_state_dir_is_no_working_directory(monkeypatch) -> None:
    """`FBX_STATE_DIR=` put the store (and the catalog of a durable box) in the working directory (tester h73)."""
    monkeypatch.setenv("FBX_STATE_DIR", " ")
    with pytest.raises(ValidationError, match="state_dir\n  Value error, is empty; give a path"):
        Settings()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--state-dir", ""], "state_dir: is empty; give a path"),
        (["--model-root", "/tmp", "--model-root", ""], "model_roots: a model root is empty; give a path"),
        (["--creds", ""], "creds: is empty; give a path"),
        (["--tls-ca", " "], "tls_ca: is empty; give a path"),
    ],
)
def test_an_empty_path_flag_is_no_working_directory(args, said, tmp_path, monkeypatch) -> None:
    """`--state-dir ""` started a box with its store in the working directory, where `FBX_STATE_DIR=` is refused (docs
    auditor h105): click read "" as Path("."). As `--model-root ""` made the working directory a model root."""
    monkeypatch.chdir(tmp_path)
    # A port out of range beside it: read as the working directory, the path would start a box, not end the test.
    result = CliRunner().invoke(cli.app, ["serve", "--port", "70000", *args])
    assert result.exit_code == 2, result.output
    assert f"fleetbox: bad settings: {said}" in result.output
    assert "bad settings: port:" in result.output  # every bad setting is said at once
    assert not list(tmp_path.iterdir())  # nothing made in the working directory


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--port", "4555", "--nats-port", "4555"], "port: 4555 is also the embedded nats-server's port"),
        (["--config", "/"], "config file / is a folder, not a file"),
    ],
)
def test_one_port_for_both_servers_or_a_folder_for_the_config_is_said_so(args, said, tmp_path) -> None:
    """Tester h73: the first read 'port 4555 on 127.0.0.1 is in use' (by the box's own nats-server, started first),
    the second 'config file / does not exist'."""
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"fleetbox: bad settings: {said}") and len(result.output.splitlines()) == 1


def test_a_metrics_key_without_any_key_is_refused() -> None:
    """`metrics_require_key = true` with no API or admin key left `/metrics` open in silence (docs auditor h105)."""
    with pytest.raises(ValidationError, match="metrics_require_key is true, but no API or admin key is set"):
        Settings(metrics_require_key=True)
    assert Settings(metrics_require_key=True, admin_keys="a").metrics_require_key
    assert Settings(metrics_require_key=True, api_keys="k").metrics_require_key
