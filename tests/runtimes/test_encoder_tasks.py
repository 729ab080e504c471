"""score, classify and extract runtimes against transformers itself on the same tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtimes import InputTooLong, ModelSource, Task, UnsupportedModel, load_runtime
from runtimes.tasks.classify import ClassifyHead, label_scores, labels_from_config
from runtimes.tasks.embed import finish_vectors
from runtimes.tasks.score import relevance_scores
from runtimes.tokenizer import model_max_length
from tests.models import copy_bert_tokenizer, with_config

from .conftest import BIO_LABELS, CLASS_LABELS

PAIRS = [
    ("what is the capital of France", "Paris is the capital of France."),
    ("fox", "The quick brown fox jumps over the lazy dog, again and again."),
    ("a much longer query about small models and batching", "Batching."),
]
TEXTS = ["I loved this film.", "Terrible.", "It was fine, I suppose, for a Tuesday afternoon."]
ENTITY_TEXTS = [
    "Alice Smith lives in Paris with Bob, near the Eiffel Tower in France.",
    "Berlin",
    "Mr. O'Neil flew from New York to São Paulo on 12 May.",
]


@pytest.fixture(scope="module")
def scorer(cross_encoder_dir: Path):
    runtime = load_runtime(ModelSource(cross_encoder_dir, Task.SCORE))
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def classifier(classifier_dir: Path):
    runtime = load_runtime(ModelSource(classifier_dir, Task.CLASSIFY))
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def extractor(token_classifier_dir: Path):
    runtime = load_runtime(ModelSource(token_classifier_dir, Task.EXTRACT))
    yield runtime
    runtime.close()


def _hf(folder: Path, auto_class: str):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = getattr(transformers, auto_class).from_pretrained(folder).eval()
    return tokenizer, model


def test_pair_rows_match_transformers_tokenizer_with_longest_first_truncation(scorer, cross_encoder_dir: Path) -> None:
    tokenizer, _ = _hf(cross_encoder_dir, "AutoModelForSequenceClassification")
    long_document = "word " * 400
    pairs = [*PAIRS, ("short query", long_document)]
    rows = scorer.tokenize_pairs(pairs)
    for row, (query, document) in zip(rows, pairs, strict=True):
        expected = tokenizer(query, document, truncation=True, max_length=scorer.info.max_length)
        assert row.ids.tolist() == expected["input_ids"]
        assert row.type_ids.tolist() == expected["token_type_ids"]
    # The long document was cut, the query kept whole.
    assert rows[-1].length == scorer.info.max_length
    assert rows[-1].ids.tolist()[: len(tokenizer("short query")["input_ids"])] == tokenizer("short query")["input_ids"]


def test_pairs_whose_both_sides_are_over_long_truncate_as_whole(scorer, cross_encoder_dir: Path) -> None:
    """Each over-long side is cut alone before the pair is tokenised (the tokenizer's windows of a long
    pair grow with the product of both sides' lengths); the rows must not change for it."""
    tokenizer, _ = _hf(cross_encoder_dir, "AutoModelForSequenceClassification")
    limit = scorer.info.max_length
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

    def text(tokens: int, shift: int = 0) -> str:
        return " ".join(words[(i + shift) % len(words)] for i in range(tokens))

    lengths = [(limit, limit), (limit + 1, limit + 1), (limit + 1, limit), (limit + 2, limit + 1)]
    lengths += [(3 * limit, limit + 1), (limit - 5, 4 * limit), (5 * limit, 5 * limit), (5 * limit, 5 * limit + 1)]
    pairs = [(text(q), text(d, shift=3)) for q, d in lengths]
    for row, (query, document) in zip(scorer.tokenize_pairs(pairs), pairs, strict=True):
        expected = tokenizer(query, document, truncation=True, max_length=limit)
        assert row.ids.tolist() == expected["input_ids"]
        assert row.type_ids.tolist() == expected["token_type_ids"]
    # Past the character cap (64 a token of the maximum) a side is cut before it is read at all: a
    # pair of 20,000-token sides fills the row half and half, which side has the odd token aside.
    (row,) = scorer.tokenize_pairs([("query " * 20_000, "document " * 20_000)])
    assert row.length == limit and abs(row.type_ids.tolist().count(0) - row.type_ids.tolist().count(1)) <= 2


def test_over_long_pair_raises_input_too_long_when_truncation_is_refused(scorer) -> None:
    with pytest.raises(InputTooLong) as error:
        scorer.tokenize_pairs([("ok", "fine"), ("query", "word " * 400)], truncate=False)
    assert error.value.index == 1


def test_score_returns_one_logit_per_pair_equal_to_the_model(scorer, cross_encoder_dir: Path) -> None:
    tokenizer, model = _hf(cross_encoder_dir, "AutoModelForSequenceClassification")
    logits = scorer.run(scorer.tokenize_pairs(PAIRS))
    assert logits.shape == (len(PAIRS),)
    with torch.no_grad():
        expected = model(**tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, return_tensors="pt"))
    np.testing.assert_allclose(logits, expected.logits[:, 0].numpy(), atol=1e-5)
    np.testing.assert_allclose(relevance_scores(logits), torch.sigmoid(expected.logits[:, 0]).numpy(), atol=1e-6)
    assert relevance_scores(logits, raw_scores=True).tolist() == logits.tolist()


@pytest.mark.parametrize(
    ("config", "activation"),
    [
        ({}, "sigmoid"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "identity"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, "tanh"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "identity"),  # before v4
        ({"sentence_transformers": {"activation_fn": "my_package.Scale"}}, "sigmoid"),  # not trusted: the default
    ],
)
def test_scores_are_what_cross_encoder_predict_returns_for_the_activation_the_config_names(
    cross_encoder_dir: Path, tmp_path: Path, config: dict, activation: str
) -> None:
    """Stock-client tester: a reranker saved with `Identity` (sentence-transformers' config.json field) answered
    sigmoids where `CrossEncoder.predict` returns the logits: same order, other thresholds."""
    from sentence_transformers import CrossEncoder

    folder = with_config(cross_encoder_dir, tmp_path / "reranker", **config)
    runtime = load_runtime(ModelSource(folder, Task.SCORE))
    assert runtime.head.activation == activation
    expected = CrossEncoder(str(folder), device="cpu").predict(PAIRS)
    np.testing.assert_allclose(runtime.head.scores(runtime.run(runtime.tokenize_pairs(PAIRS))), expected, atol=1e-5)
    runtime.close()


def test_an_activation_fleetbox_does_not_apply_is_refused_at_registration(
    cross_encoder_dir: Path, tmp_path: Path
) -> None:
    from runtimes import RuntimeKind
    from runtimes.detect import check_loadable

    config = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Softplus"}}
    folder = with_config(cross_encoder_dir, tmp_path / "softplus", **config)
    with pytest.raises(UnsupportedModel, match=r"names the activation 'torch\.nn\.modules\.activation\.Softplus'"):
        check_loadable(folder, Task.SCORE, RuntimeKind.TORCH, {})


def test_score_of_a_pair_does_not_depend_on_its_batch(scorer) -> None:
    together = scorer.run(scorer.tokenize_pairs(PAIRS))
    alone = np.concatenate([scorer.run(scorer.tokenize_pairs([pair])) for pair in PAIRS])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_relevance_sigmoid_is_stable_for_extreme_logits() -> None:
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        scores = relevance_scores(np.array([-1000.0, 0.0, 1000.0]))
    assert scores.tolist() == [0.0, 0.5, 1.0]


def test_classify_fills_labels_from_id2label_and_matches_the_pipeline(classifier, classifier_dir: Path) -> None:
    from transformers import pipeline

    assert classifier.info.labels == CLASS_LABELS
    logits = classifier.run(classifier.tokenize(TEXTS))
    assert logits.shape == (len(TEXTS), len(CLASS_LABELS))
    predictions = classifier.head.predictions(logits)
    tokenizer, model = _hf(classifier_dir, "AutoModelForSequenceClassification")
    expected = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)(TEXTS)
    for got, want in zip(predictions, expected, strict=True):
        assert [p["label"] for p in got] == [w["label"] for w in want]
        np.testing.assert_allclose([p["score"] for p in got], [w["score"] for w in want], atol=1e-5)


def test_classify_top_k_keeps_the_best_labels_sorted_descending(classifier) -> None:
    logits = classifier.run(classifier.tokenize(TEXTS))
    full = classifier.head.predictions(logits)
    top = classifier.head.predictions(logits, top_k=2)
    for whole, best in zip(full, top, strict=True):
        assert best == whole[:2]
        assert best[0]["score"] >= best[1]["score"]
        assert sum(p["score"] for p in whole) == pytest.approx(1.0, abs=1e-5)


def test_classify_raw_scores_are_the_logits_sorted() -> None:
    logits = np.array([[0.5, -2.0, 3.0]], dtype=np.float32)
    got = label_scores(logits, CLASS_LABELS, raw_scores=True)[0]
    assert [(p["label"], p["score"]) for p in got] == [("positive", 3.0), ("negative", 0.5), ("neutral", -2.0)]


def test_multi_label_classification_uses_an_independent_sigmoid_per_label() -> None:
    logits = np.array([[2.0, 2.0, -1.0]], dtype=np.float32)
    got = label_scores(logits, CLASS_LABELS, squash="sigmoid")[0]
    expected = 1 / (1 + np.exp(-logits[0]))
    assert [p["label"] for p in got] == ["negative", "neutral", "positive"]  # ties keep config order
    np.testing.assert_allclose([p["score"] for p in got], expected, atol=1e-6)


@pytest.mark.parametrize(
    ("config", "labels", "squash"),
    [
        ({"problem_type": "regression"}, 2, "none"),
        ({"problem_type": "multi_label_classification"}, 3, "sigmoid"),
        ({}, 1, "sigmoid"),
        ({}, 3, "softmax"),
        ({"problem_type": "single_label_classification"}, 3, "softmax"),
    ],
)
def test_classify_squashes_the_logits_as_the_pipeline_does(
    tmp_path: Path, classifier_dir: Path, config: dict, labels: int, squash
) -> None:
    """One label is a sigmoid, regression the outputs as they are: what the text-classification pipeline gives."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, pipeline

    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    model = BertForSequenceClassification(BertConfig(num_labels=labels, **small, **config)).eval()
    model.save_pretrained(tmp_path)  # two labels: a config.json that names none (transformers' default)
    head = ClassifyHead.from_folder(tmp_path)
    assert head.squash == squash and head.labels == tuple(model.config.id2label[i] for i in range(labels))
    logits = np.array([[1.5, -0.5, 0.25][:labels]], dtype=np.float32)
    got = label_scores(logits, tuple(model.config.id2label[i] for i in range(labels)), squash=squash)[0]
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    classifier = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)
    want = classifier.postprocess({"logits": torch.as_tensor(logits)}, top_k=None)
    want_by_label = {w["label"]: w["score"] for w in want}
    np.testing.assert_allclose([p["score"] for p in got], [want_by_label[p["label"]] for p in got], atol=1e-6)
    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)


def test_a_binary_classifier_whose_config_names_no_labels_answers_transformers_two(
    tmp_path: Path, classifier_dir: Path
) -> None:
    """transformers saves a two-label classifier's config.json without `id2label` or `num_labels` (two is its
    default): read as no labels, every answer was an empty list (black-box finding)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, pipeline

    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    model = BertForSequenceClassification(BertConfig(**small)).eval()
    model.save_pretrained(tmp_path)
    copy_bert_tokenizer(tmp_path)
    assert labels_from_config({"id2label": None, "num_labels": None}) == ("LABEL_0", "LABEL_1")  # null: not named
    runtime = load_runtime(ModelSource(tmp_path, Task.CLASSIFY))
    try:
        assert runtime.info.labels == ("LABEL_0", "LABEL_1")
        got = runtime.head.predictions(runtime.run(runtime.tokenize(TEXTS)))
    finally:
        runtime.close()
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    want = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)(TEXTS)
    for row, expected in zip(got, want, strict=True):
        assert [p["label"] for p in row] == [w["label"] for w in expected]
        np.testing.assert_allclose([p["score"] for p in row], [w["score"] for w in expected], atol=1e-5)


@pytest.mark.parametrize(
    ("family", "pad_token_id"),
    [("Roberta", 1), ("MPNet", 0)],
    ids=["roberta", "mpnet-pad-0"],
)
def test_a_folder_is_cut_to_the_positions_it_has_after_its_padding_offset(
    tmp_path: Path, family: str, pad_token_id: int
) -> None:
    """RoBERTa numbers positions from pad_token_id + 1: 66 position embeddings hold 64 tokens, not 66. MPNet
    numbers them from a padding index fixed at 1 in its code: with pad_token_id 0 in config.json the limit came out
    one token too long, the load's warm-up at that length failed (IndexError) and every request was a 503 after a
    201 (found by the black-box tester)."""
    import transformers
    from transformers import AutoModel

    config_class, model_class = getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}Model")
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    config = config_class(max_position_embeddings=66, pad_token_id=pad_token_id, **small)
    model_class(config).save_pretrained(tmp_path)
    copy_bert_tokenizer(tmp_path)  # says model_max_length 512: the position table is what bounds it
    assert model_max_length(tmp_path) == 64
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 512}')  # more than it holds (tester h88)
    assert model_max_length(tmp_path) == 64
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 32}')  # less: sentence-transformers' cut
    assert model_max_length(tmp_path) == 32
    (tmp_path / "sentence_bert_config.json").unlink()
    runtime = load_runtime(ModelSource(tmp_path, Task.EMBED))
    rows = runtime.tokenize(["word " * 200])
    assert rows[0].length == 64
    vector = runtime.run(rows)[0]
    model = AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.as_tensor(rows[0].ids).unsqueeze(0)).last_hidden_state[0].mean(0)
    np.testing.assert_allclose(vector, hidden.numpy(), atol=1e-5)  # the rows stop before normalisation
    assert runtime.info.unit_vectors  # a bare folder's vectors are normalised, per request (finish_vectors)


def test_extract_rows_carry_character_offsets_with_special_tokens_marked(extractor) -> None:
    row = extractor.tokenize(["Hello Paris"])[0]
    assert row.offsets is not None and row.offsets.shape == (row.length, 2)
    assert row.offsets[0].tolist() == [-1, -1] and row.offsets[-1].tolist() == [-1, -1]
    assert ["Hello Paris"[s:e] for s, e in row.offsets[1:-1]] == ["Hello", "Paris"]


def test_extract_spans_match_the_simple_aggregation_pipeline(extractor, token_classifier_dir: Path) -> None:
    from transformers import pipeline

    assert extractor.info.labels == BIO_LABELS
    batch = extractor.tokenize(ENTITY_TEXTS)
    logits = extractor.run(batch)
    tokenizer, model = _hf(token_classifier_dir, "AutoModelForTokenClassification")
    reference = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="simple")
    seen_labels = set()
    for text, row, row_logits in zip(ENTITY_TEXTS, batch, logits, strict=True):
        got = extractor.head.entities(text, row_logits, row.offsets)
        want = reference(text)
        assert [(e["label"], e["start"], e["end"]) for e in got] == [
            (w["entity_group"], w["start"], w["end"]) for w in want
        ]
        np.testing.assert_allclose([e["score"] for e in got], [w["score"] for w in want], atol=1e-4)
        assert all(e["text"] == text[e["start"] : e["end"]] for e in got)
        seen_labels |= {e["label"] for e in got}
    assert seen_labels == {"PER", "LOC"}  # the comparison covered both entity types


def _sentence_transformers_folder(encoder_dir: Path, folder: Path, pooling: object, dense: bool, norm: bool) -> Path:
    """The test encoder saved by sentence-transformers itself, with the given pooling, Dense and Normalize modules."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(7)
    modules: list[torch.nn.Module] = [Transformer(str(encoder_dir)), Pooling(32, pooling_mode=pooling)]
    width = 32 * (len(pooling) if isinstance(pooling, tuple) else 1)
    if dense:
        modules.append(Dense(width, 16))
    if norm:
        modules.append(Normalize())
    SentenceTransformer(modules=modules).save(str(folder))
    return folder


@pytest.mark.parametrize(
    ("pooling", "dense", "norm"),
    [
        ("cls", False, True),  # sentence-transformers 6 saves `pooling_mode`: read as mean before
        ("mean_sqrt_len_tokens", False, False),
        ("weightedmean", False, True),
        (("cls", "mean"), False, True),  # several modes: concatenated
        ("mean", True, True),  # a Dense layer after pooling (LaBSE, distiluse-*): skipped before
    ],
    ids=["cls-new-config", "mean-sqrt-len", "weighted-mean", "cls+mean", "dense"],
)
def test_embeddings_follow_every_sentence_transformers_module_of_the_folder(
    encoder_dir: Path, tmp_path: Path, pooling: object, dense: bool, norm: bool
) -> None:
    """Vectors are what SentenceTransformer.encode gives: a Dense module was skipped (other width, other space) and
    pooling modes other than cls/max/mean/last (or written in the newer `pooling_mode` key) read as mean, all with
    a 200. Found by the black-box tester."""
    from sentence_transformers import SentenceTransformer

    folder = _sentence_transformers_folder(encoder_dir, tmp_path / "st", pooling, dense, norm)
    runtime = load_runtime(ModelSource(folder, Task.EMBED))
    texts = ["A fine film, all in all.", "Alice lives in Paris, near the river and the old market."]
    got = finish_vectors(runtime.run(runtime.tokenize(texts)), folder_normalizes=runtime.info.unit_vectors)
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    runtime.close()


def test_a_sentence_transformers_module_fleetbox_cannot_run_is_refused(encoder_dir: Path, tmp_path: Path) -> None:
    import json

    from runtimes.base import RuntimeKind
    from runtimes.detect import UnsupportedModel, check_loadable

    folder = _sentence_transformers_folder(encoder_dir, tmp_path / "st", "mean", dense=False, norm=True)
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match="LayerNorm module; fleetbox runs Transformer, Pooling, Dense"):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})


def test_a_graph_that_pools_by_itself_is_not_passed_through_the_dense_layers_again(
    encoder_dir: Path, tmp_path: Path
) -> None:
    """A shipped ONNX graph with a `sentence_embedding` output holds the whole pipeline: a square Dense layer (LaBSE's
    768 -> 768) was applied a second time (cosine 0.11 to sentence-transformers). Found by review."""
    from runtimes.tasks.embed import EmbedHead, PoolingMode

    folder = _sentence_transformers_folder(encoder_dir, tmp_path / "st", "mean", dense=True, norm=False)
    dense = EmbedHead.from_folder(folder).dense[0]
    square = type(dense)(np.eye(16, dtype=np.float32) * 3, None, dense.activation)  # as LaBSE's 768 -> 768
    head = EmbedHead((PoolingMode.MEAN,), normalize=False, dense=(square,))
    pooled = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_array_equal(head.pool(pooled, np.ones((2, 3), dtype=np.int64)), pooled)


def test_a_bfloat16_dense_layer_is_read(encoder_dir: Path, tmp_path: Path) -> None:
    """numpy's safetensors reader has no bfloat16: a folder saved from a bf16 model passed registration, then every
    load failed with a TypeError. Found by review."""
    from sentence_transformers import SentenceTransformer

    from runtimes.tasks.embed import EmbedHead

    folder = _sentence_transformers_folder(encoder_dir, tmp_path / "st", "mean", dense=True, norm=True)
    model = SentenceTransformer(str(folder), device="cpu")
    model[2].to(torch.bfloat16)
    model.save(str(folder))
    layer = EmbedHead.from_folder(folder).dense[0]
    want = model[2].linear.weight.float().detach().numpy()
    np.testing.assert_array_equal(layer.weight, want)


def test_weights_shaped_unlike_the_config_are_refused_saying_so(encoder_dir: Path, tmp_path: Path) -> None:
    """A config.json whose hidden_size is not the weights': transformers' error pointed at "the above report",
    which a client never sees (black-box finding)."""
    import json
    import shutil

    folder = tmp_path / "mismatched"
    shutil.copytree(encoder_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_size": config["hidden_size"] * 2}))
    with pytest.raises(UnsupportedModel, match=r"its weights are not shaped as its config\.json says"):
        load_runtime(ModelSource(folder, Task.EMBED))
