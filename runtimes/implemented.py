"""Which model types transformers implements for each task, known without importing torch.

Registration asks this of every model folder, and a gateway-only box registers models too: importing
`transformers.models.auto.modeling_auto` (or anything that pulls in `configuration_utils`) imports
torch, 1.4 s and some 300 MB for a box that never runs a model. The tables it needs are literals in
that module's source (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict([("llama", "LlamaForCausalLM"),
...])`), so they are read from the source with `ast`, never executed. Should a transformers release
write one some other way, that table is taken from the imported module instead: slower, never wrong.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
from functools import cache
from pathlib import Path

from runtimes.base import Task

log = logging.getLogger(__name__)

_TABLES = {
    Task.EMBED: "MODEL_MAPPING_NAMES",
    Task.SCORE: "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    Task.CLASSIFY: "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    Task.EXTRACT: "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    Task.GENERATE: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
}


def implemented(model_type: str, task: Task) -> bool:
    """Whether transformers has a class of its own for `model_type` doing `task`."""
    return model_type in model_types(_TABLES[task])


@cache
def model_types(table: str) -> frozenset[str]:
    """The model types (keys) of one of modeling_auto's `*_MAPPING_NAMES` tables."""
    literal = _literal_tables().get(table)
    if literal is not None:
        return literal
    log.info("transformers' model table not read from its source; importing it", extra={"table": table})
    from transformers.models.auto import modeling_auto

    return frozenset(getattr(modeling_auto, table))


@cache
def _literal_tables() -> dict[str, frozenset[str]]:
    """Every `NAME_MAPPING_NAMES = OrderedDict([(key, value), ...])` in modeling_auto.py written as literals."""
    spec = importlib.util.find_spec("transformers")  # the package's folder; its lazy __init__ imports no torch
    if spec is None or not spec.submodule_search_locations:
        return {}
    source = Path(spec.submodule_search_locations[0]) / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    tables: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name, value = node.targets[0].id, node.value
        if not (name.endswith("_MAPPING_NAMES") and isinstance(value, ast.Call) and len(value.args) == 1):
            continue
        try:
            pairs = ast.literal_eval(value.args[0])
            tables[name] = frozenset(key for key, _ in pairs)
        except (ValueError, TypeError, SyntaxError):
            continue  # not written as literals: `model_types` imports it
    return tables
