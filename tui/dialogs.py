"""Modal dialogs: confirm a destructive action, choose a box or model, register a model, show the keys.

Each dialog is keyboard-first (its keys are on its face) and returns its answer through
`dismiss`, so the screen that opened it decides what to do with the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

TASKS = ("embed", "score", "classify", "extract", "generate")

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


class Confirm(ModalScreen[bool]):
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

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._question, classes="title")
            with Horizontal():
                yield Button(f"{self._yes} (y)", id="yes", variant="error", compact=True)
                yield Button("No (n)", id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter alone must not do the destructive thing

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class Choose(ModalScreen[str | None]):
    """Pick one of a few options (a box to load on, a model to evict) with the arrows and Enter."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="Choose") + "Choose OptionList { height: auto; max-height: 14; }"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, options: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self._title = title
        self._options = options

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title, classes="title")
            yield OptionList(*(Option(label, id=value) for value, label in self._options))
            yield Label("[dim]↑↓ choose · Enter select · Esc cancel[/]")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class RegisterForm(ModalScreen[dict | None]):
    """The body of `POST /v1/models`: name, folder, task (detected when left on auto), adapter of."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="RegisterForm")
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "submit", "Register"),
    ]

    def __init__(self, bases: Sequence[str]) -> None:
        super().__init__()
        self._bases = bases

    def compose(self) -> ComposeResult:
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
        name = self.query_one("#name", Input).value.strip()
        path = self.query_one("#path", Input).value.strip()
        if not name or not path:
            self.query_one("#problem", Label).update("[b]a name and a path are needed[/]")
            self.query_one("#name" if not name else "#path", Input).focus()
            return
        registration: dict[str, str] = {"name": name, "path": path}
        task = self.query_one("#task", Select).value
        base = self.query_one("#base", Select).value
        if isinstance(task, str):
            registration["task"] = task
        if isinstance(base, str):
            registration["adapter_of"] = base
        self.dismiss(registration)

    def action_cancel(self) -> None:
        self.dismiss(None)


class KeysHelp(ModalScreen[None]):
    """Every key of every screen, read from the bindings themselves so it never goes stale."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="KeysHelp")
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, sections: Sequence[tuple[str, Sequence[tuple[str, str]]]]) -> None:
        super().__init__()
        self._sections = sections

    def compose(self) -> ComposeResult:
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
            yield Label("[dim]↑↓ move · Tab next field · Esc closes[/]")

    def action_close(self) -> None:
        self.dismiss(None)
