"""Per-hardware profiles: slugs from device names, the selection rule (exact, nearest, defaults), what a
profile changes in a model's settings, and a real box applying one and showing it in GET /v1/models."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.catalog import Batching, ModelSpec
from appliance.devices import gpu_slug, hardware_slug
from appliance.profiles import Profile, ProfileBook, apply, choose, nearest_hardware
from appliance.settings import ModelEntry
from runtimes import RuntimeKind, Task
from tests.conftest import url

SLUG = "some-org-encoder"


def profile(hardware: str, **knobs: object) -> Profile:
    values: dict[str, object] = {
        "model": "some-org/encoder",
        "hardware": hardware,
        "runtime": "onnx",
        "dtype": "float32",
        "max_batch_tokens": 4096,
        "max_batch_size": 32,
        "max_wait_ms": 1.0,
        "threads": 8,
        "onnx_opt_level": "all",
        "measured": {"throughput": 123.4, "p99_ms": 56.7, "date": "2026-01-01", "fleetbox_version": "0.1.0"},
        "rejected": {"onnx-int8-t1": "min_cosine 0.99600 < 0.999"},
    }
    return Profile(**(values | knobs))  # type: ignore[arg-type]


def write(root: Path, *profiles: Profile) -> Path:
    for p in profiles:
        p.write(root / SLUG / f"{p.hardware}.toml")
    return root


def write_tiny_profile(root: Path) -> str:
    """This machine's profile for a model named "tiny": batches of 7 on one thread. Returns the hardware slug."""
    hardware = hardware_slug("cpu")
    Profile(
        model="tiny", hardware=hardware, runtime="torch", dtype="float32",
        max_batch_tokens=777, max_batch_size=7, max_wait_ms=0.5, threads=1,
    ).write(root / "tiny" / f"{hardware}.toml")  # fmt: skip
    return hardware


def spec(**changes: object) -> ModelSpec:
    base = ModelSpec(
        name="some-org/encoder",
        slug=SLUG,
        task=Task.EMBED,
        runtime=RuntimeKind.TORCH,
        path=Path("/models/encoder"),
        batching=Batching(16384, 256, 0.0),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("NVIDIA H200", "nvidia-h200"),
        ("NVIDIA L4", "nvidia-l4"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "nvidia-rtx-pro-6000"),
        ("NVIDIA H100 80GB HBM3", "nvidia-h100"),
        ("NVIDIA A100-SXM4-80GB", "nvidia-a100"),
        ("NVIDIA GeForce RTX 4090", "nvidia-rtx-4090"),
        ("Tesla T4", "nvidia-t4"),
    ],
)
def test_gpu_names_become_hardware_slugs(name: str, slug: str) -> None:
    assert gpu_slug(name) == slug


def test_cpu_slug_counts_the_cores_this_process_may_use() -> None:
    import os

    assert hardware_slug("cpu") == f"cpu-{len(os.sched_getaffinity(0))}c"


def test_profile_survives_a_write_and_a_read(tmp_path: Path) -> None:
    for written in (profile("cpu-2c"), profile("cpu-4c", threads=2, concurrent_batches=2)):
        path = written.write(tmp_path / f"{written.hardware}.toml")
        read = Profile.read(path)
        assert replace(read, path=None) == written


def test_exact_profile_wins_over_a_nearer_looking_one(tmp_path: Path) -> None:
    root = write(tmp_path, profile("cpu-2c"), profile("cpu-4c", max_batch_size=64))
    choice = choose(SLUG, "cpu-4c", [root])
    assert choice.match == "exact" and choice.profile is not None and choice.profile.max_batch_size == 64


def test_nearest_cpu_profile_is_the_closest_core_count(tmp_path: Path) -> None:
    assert nearest_hardware("cpu-4c", ["cpu-2c", "cpu-16c"]) == "cpu-2c"
    assert nearest_hardware("cpu-6c", ["cpu-4c", "cpu-8c"]) == "cpu-8c"
    assert nearest_hardware("cpu-4c", ["cpu-2c", "cpu-8c"]) == "cpu-2c"  # a tie goes to the smaller machine
    root = write(tmp_path, profile("cpu-16c", threads=16), profile("nvidia-h200", runtime="torch", dtype="float16"))
    choice = choose(SLUG, "cpu-2c", [root])
    assert choice.match == "nearest" and choice.profile is not None and choice.profile.hardware == "cpu-16c"
    applied = apply(spec(), choice, cores=2)
    assert applied.threads == 2  # a bigger machine's threads, capped at this one's cores
    wide = write(tmp_path / "wide", profile("cpu-16c", threads=2, concurrent_batches=8))
    applied = apply(spec(), choose(SLUG, "cpu-4c", [wide]), cores=4)
    assert (applied.threads, applied.batching.concurrent_batches) == (2, 2)  # 2 × 2 threads fill 4 cores


def test_nearest_gpu_profile_is_of_the_same_family(tmp_path: Path) -> None:
    assert nearest_hardware("nvidia-h200", ["nvidia-l4", "nvidia-h100", "cpu-2c"]) == "nvidia-h100"
    assert nearest_hardware("nvidia-l40s", ["nvidia-l4", "nvidia-h100"]) == "nvidia-l4"
    assert nearest_hardware("nvidia-a100", ["nvidia-h100", "cpu-16c"]) is None
    assert nearest_hardware("nvidia-h200", ["cpu-2c"]) is None  # a CPU profile never runs a GPU box
    assert nearest_hardware("cpu-2c", ["nvidia-h200"]) is None


def test_no_profile_means_the_models_own_settings(tmp_path: Path) -> None:
    root = write(tmp_path, profile("nvidia-h200"))
    choice = choose(SLUG, "cpu-2c", [root, tmp_path / "missing"])
    assert choice.match == "default" and choice.profile is None
    assert apply(spec(), choice) == spec()


def test_a_profile_sets_runtime_precision_batching_and_threads(tmp_path: Path) -> None:
    root = write(tmp_path, profile("cpu-2c", threads=1, concurrent_batches=2))
    applied = apply(spec(), choose(SLUG, "cpu-2c", [root]), cores=2)
    assert (applied.runtime, applied.dtype, applied.threads) == (RuntimeKind.ONNX, "float32", 1)
    assert applied.batching == Batching(4096, 32, 1.0, concurrent_batches=2)
    assert applied.options["onnx_opt_level"] == "all"
    assert applied.source("cpu", None).threads == 1
    assert applied.source("cpu", 2).threads == 2  # the box's own threads setting wins


def test_profile_off_forced_and_unreadable(tmp_path: Path) -> None:
    root = write(tmp_path, profile("cpu-2c"), profile("cpu-64c", max_batch_size=8))
    assert choose(SLUG, "cpu-2c", [root], "off").match == "off"
    forced = choose(SLUG, "cpu-2c", [root], "cpu-64c")
    assert forced.match == "forced" and forced.profile is not None and forced.profile.max_batch_size == 8
    (root / SLUG / "cpu-2c.toml").write_text("runtime = [not toml")
    assert choose(SLUG, "cpu-2c", [root]).match == "default"  # a broken file must not stop a box


def test_an_operators_profile_a_box_cannot_use_gives_way_to_the_shipped_one(tmp_path: Path) -> None:
    """A broken or unusable file in `profiles_dir` gave way to the defaults, though the shipped profile for the same
    hardware sat in the root after it (planning note of tester h72's round)."""
    shipped = write(tmp_path / "shipped", profile("cpu-2c", max_batch_size=8))
    operators = write(tmp_path / "operator", profile("cpu-2c", max_batch_size=0))
    choice = choose(SLUG, "cpu-2c", [operators, shipped])
    assert choice.match == "exact" and choice.profile is not None and choice.profile.max_batch_size == 8
    (operators / SLUG / "cpu-2c.toml").write_text("runtime = [not toml")
    assert choose(SLUG, "cpu-2c", [operators, shipped]).profile == choice.profile
    sound = write(tmp_path / "sound", profile("cpu-2c", max_batch_size=4))
    assert choose(SLUG, "cpu-2c", [sound, shipped]).profile.path == sound / SLUG / "cpu-2c.toml"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("hardware", "knobs", "problem"),
    [
        ("cpu-2c", {"max_batch_size": 0}, "max_batch_tokens must be 1 to 4194304 and max_batch_size 1 to 65536"),
        ("cpu-2c", {"max_wait_ms": 100_000.0}, "max_wait_ms must be 0 to 1000"),
        ("cpu-2c", {"concurrent_batches": 0}, "concurrent_batches must be 1 to 64"),
        ("cpu-2c", {"runtime": "torch", "dtype": "int8"}, "int8 needs the onnx runtime"),
        ("cpu-2c", {"dtype": "int4"}, "dtype 'int4' is not one of float32, float16, bfloat16, int8"),
        ("cpu-2c", {"dtype": "float16"}, "float16 ONNX graphs run on a GPU only"),
        ("nvidia-l4", {"dtype": "int8"}, "int8 ONNX graphs run on a CPU only"),
        ("cpu-2c", {"dtype": "bfloat16"}, "bfloat16 is torch's only"),  # stopped the box at start (h74)
        ("cpu-2c", {"onnx_opt_level": "bogus"}, "onnx_opt_level 'bogus' is not one of disabled, basic"),
    ],
)
def test_a_profile_a_box_cannot_run_gives_way_to_the_defaults(
    tmp_path: Path, caplog, hardware: str, knobs: dict, problem: str
) -> None:
    """Tester h72: a profile's knobs were taken as the file had them: `max_batch_size = 0` or `max_wait_ms = 100000`
    left every request to wait to its deadline, torch with int8 was a 503 `KeyError('int8')`, and a float16 ONNX
    profile on a CPU stopped the box at start. Judged as a registration is, it is logged and the defaults serve."""
    root = write(tmp_path, profile(hardware, **knobs))
    with caplog.at_level(logging.WARNING, logger="appliance.profiles"):
        choice = choose(SLUG, hardware, [root])
    assert choice.match == "default" and choice.profile is None
    (warning,) = caplog.records
    assert warning.message == "profile not usable here; not applied" and warning.error.startswith(problem)
    assert choose(SLUG, hardware, [write(tmp_path, profile(hardware))]).match == "exact"  # a sound one applies


def test_models_a_profile_cannot_fit_keep_their_settings(tmp_path: Path) -> None:
    choice = choose(SLUG, "cpu-2c", [write(tmp_path, profile("cpu-2c"))])
    for untouched in (
        spec(runtime=RuntimeKind.NOOP),
        spec(task=Task.GENERATE),
        spec(runtime=RuntimeKind.ONNX, options={"onnx_file": "/models/m.onnx"}),
    ):
        assert apply(untouched, choice) == untouched
    with_adapters = apply(spec(), choice, has_adapters=True)
    assert with_adapters.runtime is RuntimeKind.TORCH and with_adapters.batching == Batching(4096, 32, 1.0)


def test_profile_book_shows_the_choice_before_and_after_a_load(tmp_path: Path) -> None:
    book = ProfileBook("cpu-2c", [write(tmp_path, profile("cpu-4c"))], cores=2)
    preview = book.describe(spec())
    assert preview is not None and preview["match"] == "nearest" and preview["profile_hardware"] == "cpu-4c"
    applied = book.apply(spec())
    assert book.describe(spec()) == preview and applied.threads == 2
    assert book.describe(spec(runtime=RuntimeKind.NOOP)) is None
    # A base with LoRA adapters keeps torch at its load; the preview says the same.
    fresh = ProfileBook("cpu-2c", [tmp_path], cores=2)
    assert fresh.describe(spec())["runtime"] == "onnx"  # type: ignore[index]
    assert fresh.describe(spec(), has_adapters=True)["runtime"] == "torch"  # type: ignore[index]


def test_the_box_threads_setting_is_the_threads_shown_and_logged(tmp_path: Path, caplog) -> None:
    """FBX_THREADS wins over a profile's threads at the load; the record and the log say so, profile or not."""
    book = ProfileBook("cpu-2c", [write(tmp_path, profile("cpu-2c", threads=1))], cores=2, threads=2)
    assert book.describe(spec())["threads"] == 2  # type: ignore[index]
    assert book.describe(spec(profile="off"))["threads"] == 2  # type: ignore[index]
    with caplog.at_level("INFO", logger="appliance.profiles"):
        assert book.apply(spec()).threads == 2 and book.apply(spec(name="other", profile="off")).threads == 2
    assert [r.threads for r in caplog.records if r.getMessage() == "profile chosen"] == [2, 2]  # type: ignore[attr-defined]
    assert book.describe(spec())["threads"] == 2  # type: ignore[index]


async def test_box_applies_its_hardware_profile_and_lists_it(start_box, http, encoder_dir, tmp_path) -> None:
    """A real box on a real NATS: the profile's batching reaches the worker, and GET /v1/models says which."""
    hardware = write_tiny_profile(tmp_path / "profiles")
    entries = [
        ModelEntry(name="tiny", path=encoder_dir, task="embed", pinned=True),
        ModelEntry(name="tiny-untuned", path=encoder_dir, task="embed", pinned=True, profile="off"),
    ]
    box = await start_box(default_model=False, models=entries, profiles_dir=tmp_path / "profiles")
    assert box.workers["tiny"].spec.batching == Batching(777, 7, 0.5)
    assert box.workers["tiny-untuned"].spec.batching == Batching(16384, 256, 0.0)
    async with http.get(url(box, "/v1/models")) as response:
        records = {m["id"]: m for m in (await response.json())["data"]}
    shown = records["tiny"]["profile"]
    assert shown["match"] == "exact" and shown["hardware"] == hardware
    assert (shown["max_batch_tokens"], shown["max_batch_size"], shown["threads"]) == (777, 7, 1)
    assert (shown["name"], shown["tuned"]) == (f"tiny/{hardware}", True)
    untuned = records["tiny-untuned"]["profile"]
    assert (untuned["match"], untuned["name"], untuned["tuned"]) == ("off", None, False)
    # A client is told which profile, never where it lies on the box's disk.
    assert "file" not in shown and str(tmp_path) not in json.dumps(records)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "tiny", "input": ["hello", "world"]}) as r:
        assert r.status == 200 and len((await r.json())["data"]) == 2


async def test_a_box_lists_its_threads_setting_over_the_profiles(start_box, http, encoder_dir, tmp_path) -> None:
    """FBX_THREADS=2 with a profile of threads = 1: the loaded model and a `profile = "off"` one (a preview)
    both show the 2 they run with."""
    write_tiny_profile(tmp_path / "profiles")
    entries = [
        ModelEntry(name="tiny", path=encoder_dir, task="embed", pinned=True),
        ModelEntry(name="tiny-untuned", path=encoder_dir, task="embed", profile="off"),
    ]
    box = await start_box(default_model=False, models=entries, profiles_dir=tmp_path / "profiles", threads=2)
    async with http.get(url(box, "/v1/models")) as response:
        shown = {m["id"]: m["profile"] for m in (await response.json())["data"]}
    assert (shown["tiny"]["match"], shown["tiny"]["max_batch_size"], shown["tiny"]["threads"]) == ("exact", 7, 2)
    assert (shown["tiny-untuned"]["match"], shown["tiny-untuned"]["threads"]) == ("off", 2)


async def test_a_registration_chooses_its_profile(start_box, http, encoder_dir, tmp_path) -> None:
    """POST /v1/models takes `profile` as a [[models]] entry does: here "off" beats an exact profile."""
    write_tiny_profile(tmp_path / "profiles")
    box = await start_box(default_model=False, model_roots=[encoder_dir.parent], profiles_dir=tmp_path / "profiles")
    body = {"name": "tiny", "path": str(encoder_dir), "task": "embed", "profile": "../etc"}
    async with http.post(url(box, "/v1/models"), json=body) as response:
        assert response.status == 422
    async with http.post(url(box, "/v1/models"), json={**body, "profile": "off"}) as response:
        assert response.status == 201, await response.text()
        assert (await response.json())["profile"]["match"] == "off"
    async with http.post(url(box, "/v1/embeddings"), json={"model": "tiny", "input": "hello"}) as response:
        assert response.status == 200
    assert box.workers["tiny"].spec.batching != Batching(777, 7, 0.5)
