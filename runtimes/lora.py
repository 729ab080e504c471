"""LoRA adapters resident on one base model, applied per row without merging the weights.

The one idea: the base weights stay as they are, shared by every adapter, and each call says which
adapter each row uses. A call whose rows all use one adapter (every encoder batch: a request and its
batch name one adapter) switches the model to it with peft's `set_adapter` (the base: adapter layers
disabled), which runs any adapter peft can load, DoRA and a copied multi-layer head included. A call
that mixes adapters (a decode batch of requests for different adapters) goes through peft's
mixed-batch `adapter_names` (`"__base__"` for none), which can switch only LoRA layers and copies of
Linear, Embedding and Conv modules per row: a runtime whose calls mix (`mixed_rows`, the generator)
refuses adapters it could not mix. An adapter costs only its own A/B matrices (and any
`modules_to_save` copy, such as a classifier head trained with it).

peft's mixed batch looks up every row's adapter in each `modules_to_save` wrapper, and fails
(KeyError) for an adapter that saved no copy of that module while another resident adapter did; each
such wrapper gets the base's own module under the missing adapter's name (an alias, no new weights)
between peft's own changes, so those rows run the base module, as they would alone.

peft wraps the base model in place the first time an adapter is loaded (`PeftModel.from_pretrained`)
and later ones are added with `load_adapter`; eviction is `delete_adapter`. peft swaps modules in
place, and a load that fails half way (an adapter trained for another head, say) leaves them swapped,
so the base's own module tree is remembered before the first adapter: a failed first load, and the
eviction of the last adapter, put that tree back, which gives the base model exactly as it was loaded
(its own classifier head, not a `modules_to_save` copy). A failed later load deletes what it added.

Because loading, evicting and peft's per-call forward hooks all touch the shared modules, every
forward goes through `LoraAdapters.__call__`, which holds one lock: calls on one model are
serialised, as they are on one device anyway.

How the serving side uses it (every torch runtime exposes the same three methods):

    nbytes = runtime.load_adapter("support-bot", Path(".../adapters/support-bot"))
    runtime.run(batch, adapter="support-bot")      # encoder tasks: the whole batch, one adapter
    runtime.add(request_id, prompt, params, adapter="support-bot")   # generate: per request
    runtime.evict_adapter("support-bot")
    runtime.adapters                                # names resident now

An unknown name raises `UnknownAdapter`; a folder that is not a LoRA adapter raises
`UnsupportedModel`. ONNX runtimes have no adapters (load raises `UnsupportedModel`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtimes.adapter_check import check_adapter_folder
from runtimes.base import AdapterConflict, UnknownAdapter, UnsupportedModel
from runtimes.lora_layout import in_the_way, modules_adapted, unwrapped, wrapped_modules, wrapping

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
_MIXING = object()  # `_serving` after a load, an eviction or a mixed call: adapter layers on, any adapter active


class LoraAdapters:
    """The adapters on one base model, and the only way to call that model once any were loaded.

    `mixed_rows`: whether one call may give its rows different adapters (a generator's decode batch); then
    only adapters peft can apply per row are loaded."""

    def __init__(self, model: torch.nn.Module, *, mixed_rows: bool = True) -> None:
        self._base = model
        self._mixed_rows = mixed_rows
        self._peft: Any = None  # a peft.PeftModel once the first adapter is loaded
        self._tree: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # the base's modules before peft
        self._bytes: dict[str, int] = {}
        self._paths: dict[str, Path] = {}  # the folder each adapter was loaded from
        self._aliases: list[tuple[Any, str]] = []  # (modules_to_save wrapper, adapter name) given the base module
        self._serving: object = _MIXING  # what a call without adapter_names runs: an adapter's name or None (base)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let go of the model and its adapters: the runtime closing frees their memory only once nothing holds them."""
        with self._lock:
            del self._base
            self._peft = None
            self._tree = []
            self._aliases = []
            self._bytes.clear()
            self._paths.clear()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._bytes)

    def nbytes(self, name: str) -> int:
        return self._bytes[name]

    def load(self, name: str, path: Path) -> int:
        """Load the adapter in `path` as `name` (a no-op if resident from there); returns the bytes it added.

        A name resident from another folder is refused: serving the old weights for the new folder is wrong."""
        if name == BASE:
            raise UnsupportedModel(f"{BASE!r} is reserved for the base model; pick another adapter name")
        check_adapter_folder(path, mixed_rows=self._mixed_rows)
        from peft import LoraConfig, PeftModel

        with self._lock:
            if name in self._bytes:
                if self._paths[name] != Path(path):
                    raise ValueError(f"LoRA adapter {name!r} is loaded from {self._paths[name]}, not {path}")
                return self._bytes[name]
            first = self._peft is None
            if first:
                self._tree = _module_tree(self._base)
            self._before_change()
            config: Any = None
            try:
                read = LoraConfig.from_pretrained(str(path))  # judged by check_adapter_folder above
                if not first:
                    self._refuse_beside_others(name, path, read)  # before anything is injected: nothing to undo
                config = read
                # The weights come from the file: created as a plain LoRA, so no initialisation ever touches the base.
                config.init_lora_weights = True
                config.inference_mode = True
                if first:
                    self._peft = PeftModel.from_pretrained(self._base, str(path), adapter_name=name, config=config)
                else:
                    # A task subclass's add_adapter (sequence classification) puts its head in every adapter's
                    # modules_to_save: an adapter saved without a head copy (no task_type) failed to load after one.
                    add = PeftModel.add_adapter if config.task_type is None else type(self._peft).add_adapter
                    add(self._peft, name, config)  # load_adapter then reads only the weights into it
                    self._peft.load_adapter(str(path), adapter_name=name, is_trainable=False)
                _refuse_unplaced(self._peft, name, path)
                if self._mixed_rows:
                    _refuse_unmixable(self._peft, name, path)
            except Exception as error:
                # An adapter trained on another base, a cut-short weights file, a config peft cannot build from,
                # one that cannot be served per row: peft's layers may be injected and partly loaded already.
                if first:
                    self._unwrap()
                else:
                    self._drop_partial(name, config)
                    self._after_change()
                if isinstance(error, UnsupportedModel):
                    raise
                if isinstance(error, KeyError) and error.args:  # its text was the bare name, quoted (h102)
                    detail = f"it has {error.args[0]}, which this base model has no place for (made for another model?)"
                else:
                    detail = str(error)
                raise UnsupportedModel(f"LoRA adapter {path} does not fit this base model: {detail}") from error
            self._peft.eval()
            self._bytes[name] = _adapter_bytes(self._peft, name)
            self._paths[name] = Path(path)
            self._after_change()
            return self._bytes[name]

    def evict(self, name: str) -> None:
        """Delete the adapter's weights; the base model and other adapters are untouched."""
        with self._lock:
            if name not in self._bytes:
                raise UnknownAdapter(name)
            self._before_change()
            try:
                self._delete(name)
            finally:
                del self._bytes[name]
                del self._paths[name]
                if not self._bytes:
                    self._unwrap()  # peft cannot add an adapter to a wrapper left with none
                else:
                    self._after_change()

    def _delete(self, name: str) -> None:
        """peft's deletion of `name`, with one adapter active everywhere before and after it: peft picks the
        successor from what is active (a head wrapper left with none by a call for an adapter without a head
        copy made it index an empty list half way through), and leaves `active_adapter` naming the deleted
        adapter when the first LoRA layer has none left (every later forward raised KeyError)."""
        self._peft.set_adapter(name, inference_mode=True)
        self._peft.delete_adapter(name)
        rest = [other for other in self._peft.peft_config if other != name]
        if rest:
            self._peft.set_adapter(rest[0], inference_mode=True)

    def _unwrap(self) -> None:
        """Put the base's own modules back where peft swapped in its wrappers, and forget the wrapper."""
        for parent, attribute, child in self._tree:
            if getattr(parent, attribute) is not child:
                setattr(parent, attribute, child)
        if "peft_config" in vars(self._base):
            del self._base.peft_config  # set on the base by peft's tuner
        self._tree = []
        self._aliases = []
        self._peft = None
        self._serving = _MIXING

    def _before_change(self) -> None:
        """Before peft adds or deletes an adapter: its own bookkeeping must not meet the aliases, and every adapter
        layer on (layers a base-only call turned off would stay off while newly injected ones run)."""
        self._drop_aliases()
        if self._peft is not None:
            self._serve(_MIXING)  # after the change peft may have made another adapter active: still "mixing"

    def _after_change(self) -> None:
        """After peft added or deleted an adapter (or failed to): wrappers left with no copy give the base's module
        back, and the others get their aliases again."""
        self._unwrap_empty_copies()
        self._alias_gaps()

    def _refuse_beside_others(self, name: str, path: Path, config: Any) -> None:
        """Raise `AdapterConflict` when resident adapters have wrapped a module the adapter in `path` needs wrapped
        another way (`lora_layout.in_the_way`): peft refused it with its own words ("Target module
        ModulesToSaveWrapper is not supported"), which read as an adapter trained for another base, and served
        whichever of the two loaded first (h62). Called with the aliases dropped."""
        blocked = in_the_way(wrapped_modules(self._peft), modules_adapted(path, config))
        if blocked:
            where, adapters = next(iter(blocked.items()))
            raise AdapterConflict(
                f"LoRA adapter {name!r} cannot be loaded beside adapter(s) {', '.join(sorted(adapters))} on this "
                f"base: it adapts {where.removeprefix('base_model.model.')} in a way peft cannot combine with theirs "
                "(a LoRA layer, a modules_to_save copy or trainable tokens)",
                tuple(sorted(set().union(*blocked.values()))),
            )

    def _alias_gaps(self) -> None:
        """Give each `modules_to_save` wrapper the base's own module under every resident adapter it has no copy
        of, so a mixed batch finds one for each row's adapter (peft's would raise KeyError)."""
        from peft.utils.other import ModulesToSaveWrapper

        for module in self._peft.modules():
            if isinstance(module, ModulesToSaveWrapper):
                for name in self._bytes:
                    if name not in module.modules_to_save:
                        module.modules_to_save[name] = module.original_module
                        self._aliases.append((module, name))

    def _unwrap_empty_copies(self) -> None:
        """Put back the base's own module where a wrapper holds no adapter's weights any more: a `modules_to_save`
        wrapper a refused load left (a generator adapter's norm copies) failed every mixed batch, base rows included;
        a LoRA layer or trainable-tokens wrapper left by an unloaded adapter kept out an adapter that copies the
        module (peft cannot wrap a wrapper)."""
        for module_name, module in list(self._peft.named_modules()):
            found = wrapping(module)
            if found is not None and not found[1]:
                parent_name, _, attribute = module_name.rpartition(".")
                setattr(self._peft.get_submodule(parent_name), attribute, unwrapped(module))

    def _drop_aliases(self) -> None:
        for module, name in self._aliases:
            del module.modules_to_save[name]
        self._aliases = []

    def _drop_partial(self, name: str, config: Any) -> None:
        """Delete what a failed load of `name` injected next to the adapters already resident."""
        if name not in self._peft.peft_config:
            if config is None:
                return  # failed before anything was injected
            self._peft.peft_config[name] = config  # peft drops it when injection fails half way, layers and all kept
        self._delete(name)

    def check(self, names: Sequence[str | None]) -> None:
        """Raise `UnknownAdapter` for the first name that is not resident."""
        for name in names:
            if name is not None and name not in self._bytes:
                raise UnknownAdapter(name)

    def __call__(self, adapters: Sequence[str | None] | None, **inputs: Any) -> Any:
        """Run the model, row i with adapter `adapters[i]` (None: the base); `adapters=None`: all base."""
        with self._lock:
            if adapters is not None:
                self.check(adapters)
            if self._peft is None:
                return self._base(**inputs)
            used = set(adapters) if adapters is not None else {None}
            if len(used) <= 1:
                self._serve(used.pop() if used else None)
                return self._peft(**inputs)
            if not self._mixed_rows:
                raise ValueError("this model's calls run one adapter each; the rows name several")
            self._serve(_MIXING)
            return self._peft(**inputs, adapter_names=[BASE if name is None else name for name in adapters or ()])

    def _serve(self, adapter: object) -> None:
        """Switch what the model runs: one adapter's name, None for the base, `_MIXING` for a per-row call."""
        if adapter == self._serving:
            return
        tuner = self._peft.base_model
        if adapter is None:
            tuner.disable_adapter_layers()
        else:
            if self._serving is None:
                tuner.enable_adapter_layers()
            if adapter is not _MIXING:
                self._peft.set_adapter(adapter, inference_mode=True)
        self._serving = adapter


def _module_tree(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Every (parent, attribute, child) of `model`: what peft's in-place wrapping replaces."""
    return [(parent, attribute, child) for parent in model.modules() for attribute, child in parent.named_children()]


# What peft can switch per row of one batch (`adapter_names`); a `modules_to_save` copy of anything else fails.
_MIXABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _refuse_unmixable(model: torch.nn.Module, name: str, path: Path) -> None:
    """Refuse a `modules_to_save` copy of a module peft cannot switch per row (a LayerNorm, a head made of
    several layers), or trainable tokens: every call on the base, whichever adapter its rows use, would fail."""
    for module_name, module in model.named_modules():
        how, adapters = wrapping(module) or ("", set())
        if name not in adapters:
            continue
        if how == "tokens":
            # peft's mixed batch fails with it and another adapter's rows ("Length of `adapter_names` should be the
            # same as the number of inputs"), every row of the decode batch with it.
            raise UnsupportedModel(
                f"LoRA adapter {path} trains tokens of {module_name} (trainable_token_indices), which peft cannot "
                "switch per row of a batch that has other adapters' rows; save it without trainable tokens"
            )
        if how == "copy" and not isinstance(module.original_module, _MIXABLE):
            kind = type(module.original_module).__name__
            raise UnsupportedModel(
                f"LoRA adapter {path} saves its own copy of {module_name} ({kind}), which peft cannot switch "
                "per row of a batch; only Linear, Embedding and Conv modules may be in modules_to_save"
            )


def _refuse_unplaced(model: torch.nn.Module, name: str, path: Path) -> None:
    """Refuse an adapter some of whose weights found no place in the model, where peft only warns and serves the
    rest: LoRA for modules this base names otherwise (a BERT adapter on ELECTRA answered as the base), or LoRA
    on a module another resident adapter replaced with its own copy (a RoBERTa head: the LoRA was dropped)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    device = next(model.parameters()).device
    loaded = set_peft_model_state_dict(model, load_peft_weights(str(path), device=str(device)), adapter_name=name)
    unplaced = sorted(loaded.unexpected_keys)
    if unplaced:
        shared = any(other != name for other in model.peft_config)
        why = "another model, or it adapts a module another adapter here replaces with its own copy" if shared else ""
        raise UnsupportedModel(
            f"LoRA adapter {path} has {len(unplaced)} weights this base has no place for (such as "
            f"{unplaced[0].removeprefix('base_model.model.')}): it was trained on {why or 'another model'}"
        )


def _adapter_bytes(model: torch.nn.Module, name: str) -> int:
    marker = f".{name}."
    return sum(
        param.numel() * param.element_size()
        for key, param in model.named_parameters()
        if marker in key or key.endswith(f".{name}")
    )
