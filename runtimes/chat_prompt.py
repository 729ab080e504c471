"""A generator's chat prompts: a conversation rendered into prompt ids with the model's own template.

The one idea: the template is transformers' to run (its tokenizer, loaded with the model),
with control tokens typed inside a message (`<|im_end|>`, say) kept as plain text where transformers
can, so a user cannot close their turn and speak as the system. A template that raises is a `ChatTemplateError`,
the model's fault or the conversation's, told apart so the caller answers each as it should.

The caller picks what vLLM lets a client pick: the generation prompt, or continuing the final message instead,
and extra variables for the template (`enable_thinking`, say). A variable named as one of `apply_chat_template`'s
own arguments (`tokenize`, `tools`, ...) or as the conversation (`messages`) is a `ReservedTemplateVariable`:
it would change the call, not the template's text.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from runtimes.base import InputTooLong, UnsupportedModel
from runtimes.tokenizer import TextTokenizer


class ChatTemplateError(ValueError):
    """The model's chat template raised while rendering a conversation; rendering it again raises again.

    `broken`: the template itself does not compile (the model's fault). Otherwise it refused this conversation
    (`raise_exception("Conversation roles must alternate ...")`, a field it needs missing): the client's to fix.
    """

    def __init__(self, message: str, *, broken: bool) -> None:
        super().__init__(message)
        self.broken = broken


@dataclass(slots=True, frozen=True)
class TemplateControls:
    """What a request chooses of its render, as vLLM lets a client choose it: the generation prompt, or continuing
    the final message instead (transformers refuses both at once), and extra variables for the template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = field(default_factory=dict)


DEFAULT_CONTROLS = TemplateControls()
CONVERSATION = "messages"  # what a template reads the conversation as: no variable may take its place


class ReservedTemplateVariable(ValueError):
    """Template variables named as the render call's own arguments (`names`, sorted)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"{', '.join(names)}: arguments of the chat template call, not template variables")
        self.names = names


class ChatPrompts:
    """Renders conversations for one model folder; thread-safe.

    A conversation whose rendered text passes the tokenizer's character cap (`TextTokenizer.char_cap`, far more than
    `max_length` tokens span; the one a completion's prompt is cut to) is too long at once; with `truncate`, it is
    tokenised whole on a second tokenizer of its own, under a lock of its own. Tokenised under the one lock every chat
    of the model takes, a 6 MB message held it 14 s, and the model's other new chats waited (tester h111)."""

    def __init__(self, folder: Path, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer  # the runtime's: its truncation (keeping the end) and its limit
        self._lock = threading.Lock()
        # Read with the model, not at the first chat: a folder moved away after the load made every chat a
        # dead-lettered 422 naming a hub repo id (tester h74), while completions went on.
        self._chat: Any = _load_chat_tokenizer(folder)
        self._oversized: Any = None  # the second tokenizer, for conversations past the cap (made at the first)
        self._oversized_lock = threading.Lock()
        # apply_chat_template's own arguments, in the transformers installed. Read from the signature, not listed
        # here: a variable named as one would change the call, and each transformers release may add some.
        arguments = inspect.signature(self._chat.apply_chat_template).parameters.values()
        self._arguments = frozenset(p.name for p in arguments if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        truncate: bool = False,
        controls: TemplateControls = DEFAULT_CONTROLS,
    ) -> np.ndarray:
        """Prompt ids for a chat, rendered as `controls` say (by default with a generation prompt); past the
        tokenizer's `max_length`, `InputTooLong` unless `truncate` (which keeps the end)."""
        chat = self._chat_tokenizer()
        reserved = sorted(self._arguments.union({CONVERSATION}).intersection(controls.variables))
        if reserved:
            raise ReservedTemplateVariable(reserved)
        kwargs: dict[str, Any] = {
            **controls.variables,
            "add_generation_prompt": controls.add_generation_prompt,
            "continue_final_message": controls.continue_final_message,
            "tokenize": False,
        }
        conversation = [dict(m) for m in messages]
        lock = self._lock
        cap = self._tokenizer.char_cap
        try:
            estimate = len(json.dumps([conversation, controls.variables], ensure_ascii=False, default=str))
        except RecursionError:  # tried on every delivery and dead-lettered, as if the box had failed (tester h185)
            raise ValueError(_TOO_DEEP) from None
        if estimate > cap:
            # Its text may pass the cap: rendered alone (milliseconds, where tokenising took seconds) to tell.
            if len(_apply(chat, self._lock, conversation, kwargs)) > cap:
                if not truncate:
                    raise InputTooLong(0, self._tokenizer.max_length)
                chat, lock = self._oversized_tokenizer(), self._oversized_lock
        if "sanitize_control_tokens" in self._arguments:
            kwargs |= {"tokenize": True, "return_dict": False, "sanitize_control_tokens": True}
        rendered = _apply(chat, lock, conversation, kwargs)
        if isinstance(rendered, str):  # a transformers without control-token sanitising
            return self._tokenizer.tokenize([rendered], truncate=truncate, add_special_tokens=False)[0].ids
        limit = self._tokenizer.max_length
        if len(rendered) > limit and not truncate:
            raise InputTooLong(0, limit)
        return np.asarray(rendered[-limit:], dtype=np.int64)

    def _oversized_tokenizer(self) -> Any:
        """A copy of the model's tokenizer, made at the first conversation past the cap: copied, not read again from
        the folder, which may have moved since the load (review h115: then an OSError naming the box's path)."""
        with self._oversized_lock:
            if self._oversized is None:
                with self._lock:  # not while another thread uses it
                    self._oversized = copy.deepcopy(self._chat)
            return self._oversized

    def _chat_tokenizer(self) -> Any:
        if not self._chat.chat_template:
            # Not the folder: a client has no business with the box's paths (tester h81).
            raise UnsupportedModel("the model has no chat template; use plain completions (/v1/completions)")
        return self._chat


def _load_chat_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    # Its warning that a conversation passes the model's length ("will result in indexing errors"), once per model:
    # not so here, which cuts it or refuses it (tester h185: a warning in the box's log for a request served right).
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


_TOO_DEEP = (
    "a value in the messages (a tool call's JSON arguments, say) or in `chat_template_kwargs` is nested too deeply to "
    "render; send it flatter"
)


def _apply(chat: Any, lock: threading.Lock, conversation: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
    """transformers' apply_chat_template under `lock` (a tokenizer is not to be used by two threads at once), its
    template's failures as `ChatTemplateError`s."""
    with lock:
        try:
            return chat.apply_chat_template(conversation, **kwargs)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc), broken=isinstance(exc, jinja2.TemplateSyntaxError)) from None
        except RecursionError:  # a template's `tojson` of a value nested that deep
            raise ValueError(_TOO_DEEP) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # Python's own errors inside the template (`message['content'] + 1` on a list content): as
            # certain on every delivery as a raise_exception, so answered at once too.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}", broken=False) from None
