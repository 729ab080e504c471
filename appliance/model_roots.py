"""What a registration's paths may reach: its folder, and every file the box will read through it, inside a model root.

A client names a folder; the box reads it as a model's. The model roots (`model_roots`) bound what it may read:
the folder must resolve inside one (403 otherwise), and so must every link in it, since the box would read what
a link leads to as the model's own file, and a registration's error could quote it (tester h191).
"""

from __future__ import annotations

import errno
from pathlib import Path

from appliance.errors import Forbidden, Unprocessable

# What a path the client names can make the file system answer; anything else (EIO, EMFILE) is the box's trouble.
PATH_ERRNOS = frozenset(
    {errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR}
)


def resolve_under_roots(raw: str, roots: list[Path]) -> Path:
    """The folder a registration names, only if it resolves inside a model root."""
    if "\0" in raw:
        raise Unprocessable(f"path {raw!r} has a NUL character; no folder is named so", code="path_not_found")
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    try:
        resolved = candidate.resolve()
    except RuntimeError as exc:  # a symlink loop, before Python 3.13
        raise unreadable(raw, exc) from None
    except OSError as exc:  # a name too long, a loop, a folder it may not enter
        if exc.errno not in PATH_ERRNOS:
            raise
        raise unreadable(raw, exc) from None
    if _inside(resolved, roots):
        return resolved
    raise Forbidden(
        f"path {raw!r} is outside the model roots ({', '.join(map(str, roots))}); "
        "put the folder under a root, or add a root with --model-root / FBX_MODEL_ROOTS",
        code="path_outside_model_roots",
    )


def refuse_links_out(folder: Path, roots: list[Path], raw: str) -> None:
    """403 when a link in the folder (a file or a folder of it, at any depth, through links that stay in a root)
    leads outside the model roots, named by the path it is reached through. A link back up to a folder holding this
    one is not walked (the box reads nothing through it); a link that resolves nowhere (a loop) leads to no file."""
    seen: set[Path] = set()
    pending: list[tuple[Path, Path]] = [(folder, Path())]  # a folder, as resolved and as reached from `folder`
    while pending:
        current, reached = pending.pop()
        if current in seen or (current != folder and folder.is_relative_to(current)):
            continue
        seen.add(current)
        for entry in current.iterdir():
            target = entry
            if entry.is_symlink():
                try:
                    target = entry.resolve()
                except RuntimeError:  # a symlink loop, before Python 3.13: nothing is read through it
                    continue
                if not _inside(target, roots):
                    raise Forbidden(
                        f"path {raw!r} holds {reached / entry.name!s}, a link that leads outside the model roots; "
                        "copy the file into the folder, or add a root with --model-root / FBX_MODEL_ROOTS",
                        code="path_outside_model_roots",
                    )
            if target.is_dir():  # resolved: a link's target, or an entry of a resolved folder that is no link
                pending.append((target, reached / entry.name))


def unreadable(raw: str, exc: BaseException) -> Unprocessable:
    """The 422 for a path the file system refuses to follow or read (it was a 500 with a traceback)."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return Unprocessable(f"path {raw!r} cannot be read: {why}", code="path_not_found")


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)
