"""Which build of fleetbox runs: the commit its code came from. The package's version does not change between two
commits, so in a fleet being upgraded from the repository two boxes of one version ran different code and nothing
told them apart (tester h91). A box says its build in its heartbeat, `/info` (TEI's `sha`) and `fleetbox version`."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

_SOURCE = Path(__file__).resolve().parent.parent


@cache
def build_id() -> str | None:
    """`FLEETBOX_BUILD` (the image's build argument: an image holds no `.git`), else the commit of the git checkout
    the code runs from, `+dirty` when it has changes not committed; None for an installed copy without either."""
    said = os.environ.get("FLEETBOX_BUILD", "").strip()
    if said:
        return said
    if not (_SOURCE / ".git").exists():
        return None
    try:
        commit = _git("rev-parse", "--short=12", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git on the PATH, or not a repository after all
        return None
    return f"{commit}+dirty" if changed else commit


def _git(*args: str) -> str:
    """Run git in the source tree, which is trusted whoever owns it (its Python code is the code running)."""
    command = ["git", "-c", f"safe.directory={_SOURCE}", "-C", str(_SOURCE), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=5, check=True)
    return done.stdout.strip()
