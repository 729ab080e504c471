"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): every route, no 5xx, no crash.

The box is a `fleetbox serve` subprocess with a no-op model (the serving path without model cost),
API and admin keys set, and the fuzzer sends the admin key so the generated bodies reach each
route's own checks rather than stopping at the door. A bounded number of examples per route keeps
the run under a minute on two cores. Afterwards the box must still be alive and answer a normal
embeddings request.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from benchmarks._faultkit import BoxProcess

ADMIN = {"Authorization": "Bearer fuzz-admin"}
CONFIG = """default_model = false
api_keys = "fuzz-user"
admin_keys = "fuzz-admin"
default_timeout_s = 5.0

[[models]]
name = "noop"
runtime = "noop"
pinned = true
"""


@pytest.fixture(scope="module")
def fuzzed_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BoxProcess]:
    state = tmp_path_factory.mktemp("fuzzed-box")
    box = BoxProcess.spawn(state, "fuzzed", CONFIG, nats_urls=None, role="all")
    try:
        _wait_ready(box, timeout_s=120)
        yield box
    finally:
        box.terminate()  # not kill(): a SIGKILLed box leaves its embedded nats-server running


def _wait_ready(box: BoxProcess, timeout_s: float) -> None:
    """Bounded poll of /readyz (this fixture is synchronous: schemathesis drives the calls)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert box.process.poll() is None, box.log_file.read_text(errors="replace")[-3000:]
        try:
            with urllib.request.urlopen(f"{box.url}/readyz", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the fuzzed box was not ready within {timeout_s:g}s")


@pytest.fixture(scope="module")
def api_schema(fuzzed_box: BoxProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed_box.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_route_answers_5xx_to_anything_its_schema_allows(case: schemathesis.Case) -> None:
    reach_the_model(case)
    case.call_and_validate(headers=ADMIN, checks=[not_a_server_error], timeout=30)


def reach_the_model(case: schemathesis.Case) -> None:
    """Name the served model in about half the bodies, so the fuzz reaches the queue and the worker.

    A random model name stops at 404. A deadline shorter than a second is met with 504 by design
    (tests/test_worker.py covers it), so a shorter `timeout` is raised to one the box can meet.
    """
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and len(body["model"]) % 2 == 0:
        body["model"] = "noop"
    timeout = body.get("timeout")
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < 5:
        body["timeout"] = 5.0


def test_the_box_still_answers_after_the_fuzz(fuzzed_box: BoxProcess) -> None:
    """Runs after the fuzz (file order): the process lives and a normal request gets its vector."""
    assert fuzzed_box.process.poll() is None
    body = orjson.dumps({"model": "noop", "input": ["still here"]})
    request = urllib.request.Request(
        f"{fuzzed_box.url}/v1/embeddings",
        data=body,
        headers={**ADMIN, "Content-Type": "application/json"},
        method="POST",
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        payload = orjson.loads(response.read())
    assert payload["data"][0]["embedding"] == [1.0] + [0.0] * 7
    assert time.monotonic() - started < 5
