"""transformers' own config class judging a config.json as the load judges it, in this process or in a child
without torch (the registration's 422s are in test_detect.py), and refusing nothing transformers ships for a
task fleetbox serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from runtimes.base import UnsupportedModel
from runtimes.config_check import ConfigNotJudged, _judged, _judged_apart, judge_config
from runtimes.implemented import model_types
from tests.runtimes.test_detect import qwen2_dir, with_config

__all__ = ["qwen2_dir"]  # a fixture, used by being here
ROOT = Path(__file__).resolve().parents[2]
# The families a registration can reach: detect.py's tables for score/classify, extract, generate, and embed's
# bare text encoders (a sentence-transformers folder may sit on any of them).
TEXT_TABLES = (
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
)


def test_the_judgement_says_the_field_on_one_line_and_the_layer_types_the_load_reads(
    tmp_path: Path, qwen2_dir: Path
) -> None:
    assert judge_config(qwen2_dir) == ["full_attention", "full_attention"]
    folder = with_config(tmp_path / "bad", qwen2_dir, max_window_layers=0.5)
    with pytest.raises(UnsupportedModel) as error:
        judge_config(folder)
    assert str(error.value) == (
        f"{folder}/config.json does not load in transformers: Validation error for field 'max_window_layers': "
        "TypeError: Field 'max_window_layers' expected int, got float (value: 0.5)"
    )


def test_the_dtype_in_config_json_is_judged_as_the_load_judges_it(tmp_path: Path, qwen2_dir: Path) -> None:
    """The load passes its own dtype, so one config.json names wrongly is no refusal (its load succeeds)."""
    for dtype in ("float99", "auto"):
        assert judge_config(with_config(tmp_path / dtype, qwen2_dir, dtype=dtype, torch_dtype=dtype)) is not None


def test_a_child_process_without_torch_judges_as_this_process_does(
    tmp_path: Path, qwen2_dir: Path, model_dirs: dict
) -> None:
    """A gateway judges in a child that hides torch; its verdicts, refusals word for word, are this process's."""
    folders = [*model_dirs.values(), qwen2_dir]
    for i, change in enumerate(
        [
            {"use_sliding_window": "true"},
            {"use_sliding_window": True, "max_window_layers": 1, "layer_types": None},
            {"rope_parameters": "x"},
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 30},
            {"dtype": "float99"},
            {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 2},
        ]
    ):
        folders.append(with_config(tmp_path / str(i), qwen2_dir, **change))
    apart = _judged_apart([folder.resolve() for folder in folders], timeout_s=60)
    here = {str(folder.resolve()): _judged(folder.resolve()) for folder in folders}
    assert apart == here
    assert sum(verdict["refusal"] is not None for verdict in here.values()) == 4


def test_this_process_judges_only_once_a_load_has_imported_transformers_auto_classes(qwen2_dir: Path) -> None:
    """transformers' first import is not safe from two threads: a registration's judgement in this process
    while the device thread's first load imported it broke one or the other (no `AutoModel`, no `AutoConfig`).
    So with torch alone imported the child judges; once the auto classes are imported, this process does."""
    script = (
        "import sys\n"
        "import torch\n"
        "from runtimes.config_check import judge_config\n"
        f"judge_config({str(qwen2_dir)!r})\n"
        "print('transformers' in sys.modules)\n"
        "import transformers.models.auto.modeling_auto\n"
        f"judge_config({str(qwen2_dir)!r})\n"
        "print('transformers.models.qwen2.configuration_qwen2' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_the_child_runs_this_runtimes_whatever_the_working_directory_holds(
    tmp_path: Path, qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m` looks in the working directory first: a `runtimes` there judged instead of fleetbox's."""
    impostor = tmp_path / "runtimes"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("")
    (impostor / "config_check.py").write_text(
        "import json, sys\nprint(json.dumps({sys.argv[1]: {'refusal': 'fake'}}))\n"
    )
    monkeypatch.chdir(tmp_path)
    verdicts = _judged_apart([qwen2_dir.resolve()], timeout_s=60)
    assert verdicts[str(qwen2_dir.resolve())]["refusal"] is None


def test_a_judgement_that_takes_too_long_is_killed_and_refused_saying_so(qwen2_dir: Path) -> None:
    with pytest.raises(ConfigNotJudged, match=r"could not be judged by transformers within 0\.01 s; try"):
        _judged_apart([qwen2_dir], timeout_s=0.01)


def test_no_config_transformers_ships_for_a_served_task_is_refused(tmp_path: Path) -> None:
    """Every text family as transformers saves it, and with every field left to its defaults."""
    refused = []
    for model_type in sorted(set().union(*(model_types(table) for table in TEXT_TABLES))):
        try:
            saved = AutoConfig.for_model(model_type).to_dict()
        except Exception:  # a family whose defaults alone make no config: nothing to save
            continue
        for name, config in {"saved": saved, "bare": {"model_type": model_type}}.items():
            (tmp_path / "config.json").write_text(json.dumps(config))
            try:
                judge_config(tmp_path)
            except UnsupportedModel as exc:
                refused.append(f"{model_type} ({name}): {exc}")
    assert not refused, "\n".join(refused)
