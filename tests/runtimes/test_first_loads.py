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
