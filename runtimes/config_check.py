"""Whether transformers' own config class accepts a model folder's config.json, judged as the load judges it.

transformers 5 builds a config as a strict dataclass (huggingface_hub): `"use_sliding_window": "true"`,
`"max_window_layers": 0.5` or `"tie_word_embeddings": 1` is refused inside `from_pretrained`, so a
config.json that reads well as JSON can still fail every load. Rather than repeat those rules by hand,
the registration makes the load's own call, `AutoConfig.from_pretrained` with the arguments the auto
model classes pass it (runtimes/torch_backend.py), and reports its refusal. The config it builds also
says the decoder's layer types as the load's `check_full_attention` reads them.

The one idea is where the call runs. transformers' config module imports torch when torch is installed
(`modeling_rope_utils`), and a gateway-only box must never take torch in for a registration. So it runs
in this process once a load has imported torch and transformers' auto classes (a box that has loaded a
model: ~1 ms a folder), else in a short-lived child that hides torch (`sys.modules["torch"] = None`, and
transformers reads configs without it): 0.8 s and 67 MB a registration, where a child importing torch
takes 2.1 s and 250 MB (22 s from a cold disk). The verdicts are the same: the config's dtype is the one
field torch changes, and the load overrides it with its own, as this does; over 14,872 configs (every
text family transformers ships, with fields of the wrong type) the refusals were the same word for
word, and tests/runtimes/test_config_check.py holds the two against each other. A child with no verdict
within `JUDGE_TIMEOUT_S` (35 times its cost) is killed and the registration refused saying so (503,
`ConfigNotJudged`): a 201 would promise requests to a model whose load may hang or fail, while a refused
registration costs the client one retry. In this process there is no timeout (a thread cannot be
killed): it is the very work this box's load would do.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from runtimes.base import UnsupportedModel

__all__ = ["JUDGE_TIMEOUT_S", "ConfigNotJudged", "judge_config"]

JUDGE_TIMEOUT_S = 30.0
_MOST_CHARS = 300  # of transformers' refusal: it quotes the value, which may be any size
# The dtype the load passes (the runtime's, as a torch dtype); any real one makes the same verdict.
_LOAD_DTYPE = "float32"


class ConfigNotJudged(UnsupportedModel):
    """The judging child gave no verdict (it timed out, did not start, or died): nothing is known of the folder,
    so the registration is refused for now (a 503, not the client's fault) rather than let through or blamed."""


def judge_config(folder: Path, *, timeout_s: float = JUDGE_TIMEOUT_S) -> list[str] | None:
    """Raise `UnsupportedModel` where transformers refuses `folder`'s config.json, naming the field.

    Otherwise the decoder's layer types the config lists (None where it lists none).
    """
    folder = Path(folder).resolve()
    if _imported_whole("torch") and _imported_whole("transformers.models.auto.modeling_auto"):
        verdict = _judged(folder)
    else:
        verdict = _judged_apart([folder], timeout_s)[str(folder)]
    refusal = verdict.get("refusal")
    if refusal is not None:
        raise UnsupportedModel(f"{folder}/config.json does not load in transformers: {refusal}")
    return verdict.get("layer_types")


def _imported_whole(module: str) -> bool:
    """Whether `module` has been imported to its end. transformers' first import is not safe from two threads
    at once (its lazy module: a load on the device thread then found no `AutoModel`, or this no `AutoConfig`),
    so this process judges only once a load has imported its auto classes; until then the child does."""
    imported = sys.modules.get(module)
    return imported is not None and not getattr(getattr(imported, "__spec__", None), "_initializing", False)


def _judged(folder: Path) -> dict:
    """The verdict of transformers' config class on `folder`, in this process."""
    from transformers import AutoConfig

    try:
        config, _ = AutoConfig.from_pretrained(
            str(folder), dtype=_LOAD_DTYPE, local_files_only=True, trust_remote_code=False, return_unused_kwargs=True
        )
    except Exception as exc:  # what the config class raises varies: strict dataclass errors, ValueError, KeyError
        return {"refusal": _one_line(exc)}
    try:  # as runtimes.causal_lm.check_full_attention reads them at load
        layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    except Exception:  # a config with no decoder to ask: none listed
        layer_types = None
    listed = isinstance(layer_types, list | tuple) and all(isinstance(kind, str) for kind in layer_types)
    return {"refusal": None, "layer_types": list(layer_types) if listed else None}


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= _MOST_CHARS else text[: _MOST_CHARS - 3] + "..."


def _judged_apart(folders: list[Path], timeout_s: float) -> dict[str, dict]:
    """The verdicts of a child process that hides torch; `UnsupportedModel` when it gives none in time."""
    package_root = str(Path(__file__).resolve().parents[1])  # the child imports this very `runtimes`
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    # -P and the package's own folder as the working directory: never a `runtimes` found in the box's working
    # directory, and no failure where that directory was deleted under a running box.
    command = [sys.executable, "-P", "-m", "runtimes.config_check", *map(str, folders)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=package_root, check=False
        )
    except subprocess.TimeoutExpired:  # `run` has killed the child
        raise ConfigNotJudged(
            f"config.json could not be judged by transformers within {timeout_s:g} s; try the registration again"
        ) from None
    except OSError as exc:
        raise ConfigNotJudged(f"config.json could not be judged: the judging process did not start ({exc})") from None
    try:
        verdicts = json.loads(done.stdout)
        return {str(folder): dict(verdicts[str(folder)]) for folder in folders}
    except (ValueError, KeyError, TypeError):
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ConfigNotJudged(f"config.json could not be judged by transformers: {said[:_MOST_CHARS]}") from None


def main(folders: list[str]) -> None:
    """The child: hide torch, judge each folder, print `{folder: verdict}` as JSON on stdout."""
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails, transformers does without
    with contextlib.redirect_stdout(sys.stderr):  # whatever transformers prints stays out of the verdict
        verdicts = {folder: _judged(Path(folder)) for folder in folders}
    print(json.dumps(verdicts))


if __name__ == "__main__":
    main(sys.argv[1:])
