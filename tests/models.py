"""Tiny random-weight models, built once per session and saved as real model folders (shared fixtures).

Every model here goes through `save_pretrained`, so the runtimes load them exactly as they load a
downloaded model: from local files, through the same auto classes. BERT-family models reuse the
real all-MiniLM-L6-v2 tokenizer; the generator gets a byte-level BPE trained here on a few
sentences, with a ChatML template. Weights are seeded and scaled up from the default init so
logits are well separated (argmax decisions do not hinge on the last float bit). LoRA adapters are
made with peft and their B matrices perturbed, so an adapter really changes the outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks._models import GENERATOR_CORPUS, copy_bert_tokenizer, save_chatml_tokenizer
from runtimes import Task

CLASS_LABELS = ("negative", "neutral", "positive")
BIO_LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")


def _bert_config(**overrides: object) -> object:
    from transformers import BertConfig

    values: dict[str, object] = {
        "vocab_size": 30522,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "initializer_range": 0.2,
    }
    return BertConfig(**(values | overrides))


def _labelled_config(labels: tuple[str, ...], **overrides: object) -> object:
    return _bert_config(
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        **overrides,
    )


def _save_bert(folder: Path, model: torch.nn.Module) -> Path:
    model.save_pretrained(folder)
    return copy_bert_tokenizer(folder)


def _perturb_lora(model: torch.nn.Module, seed: int) -> None:
    """peft starts lora_B at zero (a no-op adapter); give it weight so the adapter matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bare BERT encoder (no sentence-transformers files): embeds with mean pooling."""
    from transformers import BertModel

    torch.manual_seed(0)
    return _save_bert(tmp_path_factory.mktemp("encoder"), BertModel(_bert_config(), add_pooling_layer=False))


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


def save_cross_encoder(folder: Path, **overrides: object) -> Path:
    """A 1-label BERT reranker (a cross-encoder) with `overrides` on its config, and the BERT tokenizer whatever
    its `vocab_size`."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    return _save_bert(folder, BertForSequenceClassification(_bert_config(num_labels=1, **overrides)))


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertForSequenceClassification

    torch.manual_seed(2)
    model = BertForSequenceClassification(_labelled_config(CLASS_LABELS))
    return _save_bert(tmp_path_factory.mktemp("classifier"), model)


@pytest.fixture(scope="session")
def token_classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertForTokenClassification

    # Seed and scale chosen so the random head predicts every tag somewhere in a sentence.
    torch.manual_seed(6)
    model = BertForTokenClassification(_labelled_config(BIO_LABELS, initializer_range=0.5))
    return _save_bert(tmp_path_factory.mktemp("token-classifier"), model)


@pytest.fixture(scope="session")
def generator_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with a byte-level BPE tokenizer and a ChatML chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_generator(tmp_path_factory.mktemp("generator"), LlamaConfig, LlamaForCausalLM)


def save_long_context_encoder(folder: Path) -> Path:
    """A 1-layer BERT with 512 positions: its warm-up activations outweigh its weights, so the bytes its load
    measures (about 8 MB on CPU) are far above the estimate from its weight file (about 5 MB)."""
    from transformers import BertModel

    torch.manual_seed(7)
    config = _bert_config(num_hidden_layers=1, max_position_embeddings=512)
    return _save_bert(folder, BertModel(config, add_pooling_layer=False))


def with_config(source: Path, folder: Path, **changes: object) -> Path:
    """A copy of a model folder with fields of its config.json changed, over the same weights."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    return folder


# A binary classifier's labels, for a folder given a classifier's config.json.
YES_NO = {"id2label": {"0": "no", "1": "yes"}, "label2id": {"no": 0, "yes": 1}}


def save_roberta_classifier(folder: Path) -> Path:
    """A RoBERTa classifier the size of the BERT ones (its head two layers: classifier.dense, classifier.out_proj),
    with the BERT tokenizer (whose pad id, 0, its config names)."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(5)
    config = RobertaConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=130, pad_token_id=0, initializer_range=0.2, num_labels=len(CLASS_LABELS),
        id2label=dict(enumerate(CLASS_LABELS)), label2id={label: i for i, label in enumerate(CLASS_LABELS)},
    )  # fmt: skip
    RobertaForSequenceClassification(config).save_pretrained(folder)
    return copy_bert_tokenizer(folder)


def save_generator(folder: Path, config_class: type, model_class: type, **overrides: object) -> Path:
    """A 2-layer causal LM of one transformers family (the generator's tokenizer, sizes and seed), saved to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    bpe = save_chatml_tokenizer(folder, GENERATOR_CORPUS, 256)
    torch.manual_seed(4)
    values: dict[str, object] = {
        "vocab_size": bpe.get_vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.2,
        "eos_token_id": bpe.token_to_id("<|im_end|>"),
        "pad_token_id": bpe.token_to_id("<|endoftext|>"),
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    model_class(config_class(**(values | overrides))).save_pretrained(folder)
    return folder


# (auto class, peft task type, target modules) per task, for adapters on the models above.
ADAPTER_KINDS = {
    Task.EMBED: ("AutoModel", "FEATURE_EXTRACTION", ["query", "value"]),
    Task.SCORE: ("AutoModelForSequenceClassification", "SEQ_CLS", ["query", "value"]),
    Task.CLASSIFY: ("AutoModelForSequenceClassification", "SEQ_CLS", ["query", "value"]),
    Task.EXTRACT: ("AutoModelForTokenClassification", "TOKEN_CLS", ["query", "value"]),
    Task.GENERATE: ("AutoModelForCausalLM", "CAUSAL_LM", ["q_proj", "v_proj"]),
}


def make_adapter(task: Task, base_dir: Path, folder: Path, seed: int, **lora: object) -> Path:
    """A LoRA for the model in `base_dir`, saved by peft, with `lora` set on its LoraConfig (`use_dora`,
    `modules_to_save`, `task_type`...); SEQ_CLS/TOKEN_CLS ones carry their own head copy."""
    import transformers
    from peft import LoraConfig, get_peft_model

    auto_class, task_type, targets = ADAPTER_KINDS[task]
    base = getattr(transformers, auto_class).from_pretrained(base_dir)
    torch.manual_seed(seed)
    config = LoraConfig(**({"task_type": task_type, "r": 4, "lora_alpha": 8, "target_modules": targets} | lora))
    peft_model = get_peft_model(base, config)
    _perturb_lora(peft_model, seed)
    if config.use_dora:  # DoRA's magnitudes start at the base's column norms: make them matter too
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_magnitude_vector" in name:
                    param.mul_(1.5)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_dirs(
    encoder_dir: Path, cross_encoder_dir: Path, classifier_dir: Path, token_classifier_dir: Path, generator_dir: Path
) -> dict[Task, Path]:
    return {
        Task.EMBED: encoder_dir,
        Task.SCORE: cross_encoder_dir,
        Task.CLASSIFY: classifier_dir,
        Task.EXTRACT: token_classifier_dir,
        Task.GENERATE: generator_dir,
    }


@pytest.fixture(scope="session")
def adapter_dirs(model_dirs: dict[Task, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[Task, Path]:
    """One LoRA adapter per task, on that task's model."""
    return {
        task: make_adapter(task, folder, tmp_path_factory.mktemp(f"{task}-lora"), seed=10 + i)
        for i, (task, folder) in enumerate(model_dirs.items())
    }


@pytest.fixture(scope="session")
def second_generator_adapter_dir(generator_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(Task.GENERATE, generator_dir, tmp_path_factory.mktemp("generate-lora-2"), seed=99)
