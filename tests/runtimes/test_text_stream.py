"""Streaming text out of tokens: stop strings and half-made characters.

The decoder here is a stand-in (one token is one UTF-8 byte) because the behaviour under test is
how `TextStream` releases text, whatever tokenizer produced it.
"""

from __future__ import annotations

import pytest
import torch

from runtimes.tasks.generate import SamplingParams, TextStream, choose_tokens


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream_all(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    stream = TextStream(byte_decode, [], stop)
    deltas = []
    for byte in text.encode():
        delta, stopped = stream.push(byte)
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(stream.finish()[0])
    return deltas, False


def test_without_stop_strings_every_delta_is_released_and_adds_up() -> None:
    deltas, stopped = stream_all("hello world")
    assert "".join(deltas) == "hello world" and not stopped
    assert deltas[:5] == ["h", "e", "l", "l", "o"]


def test_a_multi_byte_character_is_released_only_when_complete() -> None:
    deltas, _ = stream_all("né")
    assert deltas == ["n", "", "é", ""]


def test_text_that_may_start_a_stop_string_is_held_back_then_released() -> None:
    deltas, stopped = stream_all("a<b<c", stop=("<d>",))
    assert not stopped
    assert deltas == ["a", "", "<b", "", "<c", ""]


def test_a_stop_string_ends_the_text_just_before_it() -> None:
    deltas, stopped = stream_all("one two\n\nthree", stop=("\n\n", "xyz"))
    assert stopped and "".join(deltas) == "one two"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    deltas, stopped = stream_all("abcdef", stop=("def", "cd"))
    assert stopped and "".join(deltas) == "ab"


def test_a_stop_string_split_across_tokens_is_found() -> None:
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), [], ("END",))
    assert stream.push(ord("x")) == ("x", False)
    assert stream.push(ord("E")) == ("", False)
    assert stream.push(ord("N")) == ("", False)
    assert stream.push(ord("D")) == ("", True)
    assert stream.text == "x"


def test_greedy_picks_the_argmax_and_sampling_respects_the_seed() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    assert choose_tokens(logits[None], [SamplingParams(temperature=0)], [None]) == [1]
    params = SamplingParams(temperature=1.0)
    draws = [choose_tokens(logits[None], [params], [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert len(set(draws)) == 1
    many = {choose_tokens(logits[None], [params], [torch.Generator().manual_seed(s)])[0] for s in range(50)}
    assert many >= {1, 2}


def test_top_p_excludes_tokens_outside_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    drawn = {choose_tokens(logits[None], [params], [torch.Generator().manual_seed(s)])[0] for s in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}], ids=str)
def test_invalid_sampling_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_stop_string_in_the_text_held_back_at_max_tokens_ends_it_as_a_stop() -> None:
    """Tester h111: the last token leaves half a character held back; at `max_tokens` it is released as U+FFFD, and
    a stop string ending in it cut the text but the finish reason said "length"."""
    from runtimes.decoding import Decoding

    tokens = [*b'ab"', 0xE2]  # the last, half of a three-byte character
    decoding = Decoding(
        request_id="r",
        prompt=torch.tensor([1]),
        params=SamplingParams(),
        adapter=None,
        max_new=len(tokens),
        stream=TextStream(byte_decode, [], ('"\ufffd',)),
        generator=None,
    )
    outputs = [decoding.emit(token, eos=frozenset()) for token in tokens]
    assert "".join(output.text_delta for output in outputs) == "ab"
    assert (outputs[-1].finished, outputs[-1].finish_reason) == (True, "stop")
