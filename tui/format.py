"""Small, fixed-width renderings for table cells: bytes, bars, ages, rates, latencies.

Every function returns text no wider than it says, so columns line up at 80 columns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text

_UNITS = ("B", "K", "M", "G", "T")


def human_bytes(n: int | None) -> str:
    """1536 -> '1.5K'; at most 5 characters."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(value)}B"
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
        value /= 1024
    return f"{n}B"  # unreachable: the loop returns at the last unit


def short_name(name: str, width: int) -> str:
    """A model or box name cut to `width`, keeping the informative end of an org/name id."""
    if len(name) <= width:
        return name
    if "/" in name:
        name = "…/" + name.rsplit("/", 1)[-1]
        if len(name) <= width:
            return name
    return name[: width - 1] + "…"


def bar(used: int, total: int, width: int = 10) -> Text:
    """A filled bar of `width` cells, coloured by how full it is; unknown totals show as empty."""
    if total <= 0:
        return Text("─" * width, style="dim")
    share = min(max(used / total, 0.0), 1.0)
    filled = round(share * width)
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def usage(used: int, total: int, width: int = 8) -> Text:
    """'████░░░░ 1.2G/8.0G': a bar and the figures (width + 12 characters)."""
    figures = f" {human_bytes(used)}/{human_bytes(total) if total > 0 else '?'}"
    return Text.assemble(bar(used, total, width), figures)


def share(used: int, total: int, width: int = 5) -> Text:
    """'███░░ 46%': a bar and the percentage (width + 5 characters)."""
    if total <= 0:
        return Text.assemble(bar(used, total, width), "   ?")
    return Text.assemble(bar(used, total, width), f"{min(999, round(100 * used / total)):>4}%")


def limit(value: int, maximum: int, render: Callable[[int], str] = str) -> str:
    """'12 / 100000', or '12 / ∞' for an unlimited stream setting (-1 or 0)."""
    return f"{render(value)} / {render(maximum) if maximum > 0 else '∞'}"


def age(seconds: float) -> str:
    """0.4 -> '0s', 75 -> '1m15s', 7300 -> '2h01m'; at most 5 characters."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def rate(rps: float) -> str:
    if rps <= 0:
        return "-"
    return f"{rps:.1f}" if rps < 100 else f"{rps:.0f}"


def ms(value: float) -> str:
    if value <= 0:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def clock(at: float) -> str:
    """Local wall-clock time of an event, HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(at))


def count(n: int, noun: str) -> str:
    """'1 box', '3 boxes', '0 models': a count with its noun in the right number."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "x", "ch", "sh")) else f"{n} {noun}s"
