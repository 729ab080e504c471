"""The generate runtime's inbox: what a step takes, in which order, and what a cancel or a failed step does."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from runtimes.inbox import Inbox


@dataclass(frozen=True)
class Waiting:
    request_id: str
    tokens: int


def inbox_of(*requests: Waiting) -> Inbox[Waiting]:
    inbox: Inbox[Waiting] = Inbox()
    for request in requests:
        inbox.add(request)
    return inbox


def size(request: Waiting) -> int:
    return request.tokens


def test_a_step_takes_in_arrival_order_within_its_room_and_prompt_budget() -> None:
    inbox = inbox_of(Waiting("a", 5), Waiting("b", 5), Waiting("c", 5), Waiting("d", 5))
    assert inbox.take(2, 100, size) == ([Waiting("a", 5), Waiting("b", 5)], set())
    assert inbox.take(5, 8, size) == ([Waiting("c", 5)], set())  # d would pass 8 prompt tokens
    assert inbox.take(5, 1, size) == ([Waiting("d", 5)], set())  # the first always goes, however long
    assert inbox.has_work  # taken, not finished
    inbox.forget(["a", "b", "c", "d"])
    assert not inbox.has_work


def test_a_cancel_drops_a_waiting_request_and_is_handed_to_the_step_once() -> None:
    inbox = inbox_of(Waiting("a", 1), Waiting("b", 1))
    inbox.cancel("a")
    inbox.cancel("nobody")
    assert inbox.take(5, 100, size) == ([Waiting("b", 1)], {"a"})
    assert inbox.take(5, 100, size) == ([], set())


def test_requests_put_back_after_a_failed_step_go_first_in_their_order() -> None:
    inbox = inbox_of(Waiting("a", 1), Waiting("b", 1))
    taken, _ = inbox.take(5, 100, size)
    inbox.add(Waiting("c", 1))
    inbox.put_back(taken)
    assert [r.request_id for r in inbox.waiting()] == ["a", "b", "c"]


def test_an_id_is_taken_once_until_it_is_forgotten() -> None:
    inbox = inbox_of(Waiting("a", 1))
    with pytest.raises(ValueError, match="already generating"):
        inbox.add(Waiting("a", 1))
    assert inbox.clear() == ["a"] and not inbox.has_work
    inbox.add(Waiting("a", 1))


def test_forgetting_a_request_forgets_its_cancel_too() -> None:
    """A cancel that came as its request finished must not drop a later request of the same id."""
    inbox = inbox_of(Waiting("a", 1))
    inbox.take(5, 100, size)
    inbox.cancel("a")
    inbox.forget(["a"])
    inbox.add(Waiting("a", 1))
    assert inbox.take(5, 100, size) == ([Waiting("a", 1)], set())


def test_after_a_failed_step_every_request_not_waiting_is_forgotten() -> None:
    """Those decoding, and any taken and not put back: none may stay live with nothing to step it."""
    inbox = inbox_of(Waiting("a", 1), Waiting("b", 1), Waiting("c", 1))
    inbox.take(2, 100, size)  # a and b join the batch
    inbox.cancel("b")
    assert inbox.forget_running() == ["a", "b"]
    assert [r.request_id for r in inbox.waiting()] == ["c"]
    assert inbox.take(5, 100, size) == ([Waiting("c", 1)], set())
