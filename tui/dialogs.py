"""Modal dialogs: confirm a destructive action, choose a box or model, register a model, show the keys.

Each dialog is keyboard-first (its keys are on its face and in its own footer) and answers once,
through `dismiss`, so the screen that opened it decides what to do with the answer. Once is the
rule: keys typed quickly (Enter twice in one write) reach a dialog that is already closing, and a
second dismiss would close the screen below it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

from tui.format import short_name
from tui.ops import new_name_problem

TASKS = ("embed", "score", "classify", "extract", "generate")
T = TypeVar("T")

_DIALOG_CSS = """
{name} {{
    align: center middle;
}}
{name} > Vertical {{
    width: 64;
    max-width: 100%;
    height: auto;
    max-height: 100%;
    border: round $primary;
    padding: 0 1;
    background: $surface;
}}
{name} .title {{
    text-style: bold;
    width: 100%;
    margin-bottom: 1;
}}
{name} .field {{
    height: 1;
    margin-bottom: 1;
    align-horizontal: left;
}}
{name} .field Label {{
    width: 12;
}}
{name} .field Input, {name} .field Select {{
    width: 1fr;
}}
{name} Horizontal {{
    height: auto;
    align-horizontal: right;
}}
{name} Button {{
    margin-left: 1;
    min-width: 12;
}}
"""


class Dialog(ModalScreen[T]):
    """A modal that answers once and shows its own keys in a footer (not those of the screen below)."""

    _answered = False

    def compose(self) -> ComposeResult:
        yield from self.face()
        yield Footer(show_command_palette=False, compact=True)

    def face(self) -> ComposeResult:
        raise NotImplementedError

    def answer(self, value: T) -> None:
        """Close the dialog with `value`; any later answer (a key typed twice) is ignored."""
        if self._answered:
            return
        self._answered = True
        self.dismiss(value)


class Confirm(Dialog[bool]):
    """Ask before something that cannot be taken back (evict, drain, stop)."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="Confirm")
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self._question = question
        self._yes = yes

    def face(self) -> ComposeResult:
        with Vertical():
            yield Label(self._question, classes="title")
            with Horizontal():
                yield Button(f"{self._yes} (y)", id="yes", variant="error", compact=True)
                yield Button("No (n)", id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter alone must not do the destructive thing

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.answer(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.answer(yes)


class Choose(Dialog[str | None]):
    """Pick one of a few options (a box to load on, a model to evict) with the arrows and Enter."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="Choose") + "Choose OptionList { height: auto; max-height: 14; }"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, options: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self._title = title
        self._options = options

    def face(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title, classes="title")
            yield OptionList(*(Option(label, id=value) for value, label in self._options))
            yield Label("[dim]↑↓ choose · Enter select · Esc cancel[/]")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.answer(event.option.id)

    def action_cancel(self) -> None:
        self.answer(None)


Register = Callable[[dict[str, Any]], Awaitable[str | None]]  # a registration -> why it was refused, or None


class RegisterForm(Dialog[dict | None]):
    """The body of `POST /v1/models`: name, folder, task (detected when left on auto), adapter of.

    The form sends the registration itself and closes only when a box accepts it: a refusal (a
    folder outside the model roots, a name taken) is shown in the form, with everything typed kept.
    """

    DEFAULT_CSS = _DIALOG_CSS.format(name="RegisterForm") + "RegisterForm #problem { width: 100%; }"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "submit", "Register"),
    ]

    def __init__(self, bases: Sequence[str], register: Register) -> None:
        super().__init__()
        self._bases = bases
        self._register = register
        self._sending = False

    def face(self) -> ComposeResult:
        with Vertical():
            yield Label("Register a model (a folder under a model root of the box)", classes="title")
            with Horizontal(classes="field"):
                yield Label("name")
                yield Input(placeholder="e.g. my-embedder", id="name", compact=True)
            with Horizontal(classes="field"):
                yield Label("path")
                yield Input(placeholder="the folder, on the box", id="path", compact=True)
            with Horizontal(classes="field"):
                yield Label("task")
                yield Select([(t, t) for t in TASKS], prompt="detect from the files", id="task", compact=True)
            with Horizontal(classes="field"):
                yield Label("adapter of")
                yield Select([(b, b) for b in self._bases], prompt="none: a model", id="base", compact=True)
            yield Label("", id="problem")
            with Horizontal():
                yield Button("Register (ctrl+s)", id="register", variant="primary", compact=True)
                yield Button("Cancel (esc)", id="cancel", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "register":
            self.action_submit()
        else:
            self.action_cancel()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_submit()

    def action_submit(self) -> None:
        if self._sending:  # one registration at a time: ctrl+s twice sends it once
            return
        name = self.query_one("#name", Input).value.strip()
        path = self.query_one("#path", Input).value.strip()
        if not name or not path:
            self._say(Text("a name and a path are needed", style="bold"))
            self.query_one("#name" if not name else "#path", Input).focus()
            return
        problem = new_name_problem(name)
        if problem:  # said here in one line, as the CLI says it; no box is asked
            self._say(Text.assemble(("refused: ", "bold"), f"the name {problem}"))
            self.query_one("#name", Input).focus()
            return
        registration: dict[str, str] = {"name": name, "path": path}
        task = self.query_one("#task", Select).value
        base = self.query_one("#base", Select).value
        if isinstance(task, str):
            registration["task"] = task
        if isinstance(base, str):
            registration["adapter_of"] = base
        self._sending = True
        self._say(Text(f"registering {short_name(name, 40)}…", style="dim"))
        self.run_worker(self._send(registration), group="register", exit_on_error=False)

    async def _send(self, registration: dict[str, str]) -> None:
        try:
            refused = await self._register(registration)
        finally:
            self._sending = False
        if refused is None:
            self.answer(registration)
        elif not self._answered:  # not cancelled meanwhile
            self._say(Text.assemble(("refused: ", "bold"), refused))

    def _say(self, text: Text) -> None:
        self.query_one("#problem", Label).update(text)  # Text, not markup: a box's message may hold brackets

    def action_cancel(self) -> None:
        self.answer(None)


class KeysHelp(Dialog[None]):
    """Every key: the screens' read from their bindings (so they never go stale), the tables' and the dialogs'."""

    DEFAULT_CSS = (
        _DIALOG_CSS.format(name="KeysHelp") + "KeysHelp > Vertical { width: 78; } KeysHelp .title { margin: 0; }"
    )
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, sections: Sequence[tuple[str, Sequence[tuple[str, str]]]]) -> None:
        super().__init__()
        self._sections = sections

    def face(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 1), expand=False)
        table.add_column(style="bold")
        table.add_column(style="reverse")
        table.add_column()
        for where, keys in self._sections:
            for index, (key, description) in enumerate(keys):
                table.add_row(where if index == 0 else "", f" {key} ", description)
        with Vertical():
            yield Label("Keys", classes="title")
            yield Static(table)

    def action_close(self) -> None:
        self.answer(None)


# The dialogs' keys, for the help: their bindings, and the keys their widgets answer themselves.
DIALOG_KEYS = (
    ("y / n", "yes / no, in a confirmation"),
    ("Enter", "choose the option, or press the focused button"),
    ("Tab", "next field or button (shift+Tab: back)"),
    ("ctrl+s", "register, in the register form"),
    ("Esc", "cancel, close"),
)
