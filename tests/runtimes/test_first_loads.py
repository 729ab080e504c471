"""A fresh process's first loads, several at once (a box's pinned models, or cold models asked for together)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtimes import Task

ROOT = Path(__file__).resolve().parents[2]


def test_a_fresh_process_loads_several_models_at_once(model_dirs: dict[Task, Path]) -> None:
    """transformers' lazy first import is not safe from two threads: one of a fresh box's first loads run at
    once failed with `no attribute 'AutoModel'` or `cannot import name 'DynamicCache'` (3 runs in 3 for the
    black-box tester), cached as the model's load error. Each load here runs on its own thread, as a box's do."""
    folders = {task.value: str(folder) for task, folder in model_dirs.items()}
    script = (
        "import json, sys, threading\n"
        "from pathlib import Path\n"
        "from runtimes import ModelSource, Task, load_runtime\n"
        "folders = json.loads(sys.argv[1])\n"
        "failures = []\n"
        "def load(task, folder):\n"
        "    try:\n"
        "        load_runtime(ModelSource(Path(folder), Task(task))).close()\n"
        "    except Exception as exc:\n"
        "        failures.append(f'{task}: {exc!r}')\n"
        "threads = [threading.Thread(target=load, args=item) for item in folders.items()]\n"
        "for thread in threads: thread.start()\n"
        "for thread in threads: thread.join()\n"
        "print(json.dumps(failures))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(folders)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_tied_generators_loaded_at_once_all_load(tmp_path: Path) -> None:
    """transformers builds a model on the meta device, then ties its weights: two tied-embedding generators loaded
    at once left lm_head on the meta device in both ('Cannot copy out of meta tensor'; 10 of 15 loads here before),
    and each model answered 503 for 30 s. Found by the black-box tester."""
    import threading

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from runtimes import ModelSource, load_runtime
    from tests.models import save_generator

    llama = save_generator(tmp_path / "llama", LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True)
    gpt2 = save_generator(tmp_path / "gpt2", GPT2Config, GPT2LMHeadModel, n_head=4, n_layer=2)
    failures: list[str] = []

    def load(folder: Path) -> None:
        try:
            load_runtime(ModelSource(folder, Task.GENERATE)).close()
        except Exception as exc:
            failures.append(repr(exc))

    for _ in range(3):
        threads = [threading.Thread(target=load, args=(folder,)) for folder in (llama, gpt2, llama)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert failures == []
