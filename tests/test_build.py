"""The build a box says it runs (`appliance.build`): the package's version alone did not tell two commits apart."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from appliance import build
from appliance.box_status import heartbeat

ROOT = Path(build.__file__).resolve().parent.parent


@pytest.fixture
def fresh_build_id():
    build.build_id.cache_clear()
    yield build.build_id
    build.build_id.cache_clear()


def test_a_checkout_says_its_commit_and_whether_it_has_changes(fresh_build_id, monkeypatch) -> None:
    monkeypatch.delenv("FLEETBOX_BUILD", raising=False)
    if not (ROOT / ".git").exists():  # an installed copy: nothing to say
        assert fresh_build_id() is None
        return
    git = ["git", "-c", f"safe.directory={ROOT}", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    said = fresh_build_id()
    assert said is not None and head.stdout.startswith(said.removesuffix("+dirty")) and len(said) >= 12


def test_the_image_build_argument_is_said_over_the_checkout(fresh_build_id, monkeypatch) -> None:
    monkeypatch.setenv("FLEETBOX_BUILD", " 0123456789ab ")
    assert fresh_build_id() == "0123456789ab"


async def test_a_heartbeat_says_the_build(start_box) -> None:
    box = await start_box(default_model=False, models=[])
    assert heartbeat(box)["build"] == build.build_id() == box.build
