"""The output processor, fed hand-made tokens through the demo model's real tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from client import Delta, Done, Timing
from worker.engine.backends import TokenOut
from worker.engine.output import RequestOutput, process_step
from worker.messages import EngineRequest, Queueing, Reporting, RequestRef, SamplingParams, Stopping


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_model)


def make_request(stop: list[str] | None = None, interval: int = 1, max_tokens: int = 100) -> EngineRequest:
    return EngineRequest(ref=RequestRef("r1", "1-0"), prompt_tokens=[1, 2, 3], sampling=SamplingParams(),
                         stopping=Stopping(max_tokens, stop or []), queueing=Queueing(0, 100.0),
                         reporting=Reporting(stream_interval=interval))


def feed(tokenizer, request: EngineRequest, tokens: list[int], last_reason: str | None = "length",
         flushes: set[int] | None = None):
    """Events of `tokens` fed one a step; with `flushes`, only those steps flush."""
    stream = RequestOutput(request, tokenizer.detokenizer, admitted_at=100.5)
    events = []
    for i, token in enumerate(tokens):
        reason = last_reason if i == len(tokens) - 1 else None
        events += stream.add(TokenOut(0, token, reason), now=101.0 + i, flush=flushes is None or i in flushes)
        if stream.done:
            break
    return events


def texts(events) -> list[str]:
    return [e.text for e in events if isinstance(e, Delta)]


def test_multibyte_text_never_splits_a_character(tokenizer):
    """Byte-level tokens of multi-byte characters are held until the character is whole."""
    text = "naïve café → 世界 ok"
    events = feed(tokenizer, make_request(), tokenizer.encode(text))
    assert all("\ufffd" not in t for t in texts(events))
    assert "".join(texts(events)) == events[-1].text == text


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer):
    """A stop string split over several tokens ends the request; no part of it was ever sent."""
    tokens = tokenizer.encode("alpha beta STOPPING gamma delta")
    events = feed(tokenizer, make_request(stop=["STOP"]), tokens)
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert done.text == "alpha beta "
    assert "".join(texts(events)) == done.text
    assert not any("S" in t for t in texts(events))


def test_text_that_might_start_a_stop_string_is_released_when_it_does_not(tokenizer):
    """Held-back text that turns out not to be a stop string is streamed later, not lost."""
    tokens = tokenizer.encode("one STOq two")
    events = feed(tokenizer, make_request(stop=["STOP"]), tokens)
    assert events[-1].finish_reason == "length"
    assert "".join(texts(events)) == events[-1].text == "one STOq two"


def test_eos_ends_the_request_and_is_not_output(tokenizer):
    """An eos token finishes with `stop` and adds neither text nor a token id."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = tokenizer.encode("hello world")
    events = feed(tokenizer, make_request(), [*tokens, eos], last_reason="stop")
    done = events[-1]
    assert done.finish_reason == "stop" and done.text == "hello world"
    assert eos not in [t for e in events if isinstance(e, Delta) for t in e.tokens]
    assert done.usage.completion_tokens == len(tokens)


def test_stream_interval_coalesces_tokens(tokenizer):
    """Deltas carry `stream_interval` tokens each; the last one carries the rest."""
    tokens = tokenizer.encode("a b c d e f g h i j")
    events = feed(tokenizer, make_request(interval=4), tokens)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [len(d.tokens) for d in deltas] == [4] * (len(tokens) // 4) + ([len(tokens) % 4] if len(tokens) % 4 else [])
    assert [d.seq for d in deltas] == list(range(len(deltas)))


def test_between_flushes_tokens_wait_for_one_delta_but_the_first_never_waits(tokenizer):
    """Steps that do not flush hold their tokens; the next flush sends them as one delta,
    the first token goes out at once, and the end sends what is held."""
    tokens = tokenizer.encode("a b c d e f g h i j")
    events = feed(tokenizer, make_request(), tokens, flushes={4})
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [len(d.tokens) for d in deltas] == [1, 4, len(tokens) - 5]
    assert [d.seq for d in deltas] == [0, 1, 2]
    assert "".join(texts(events)) == events[-1].text == tokenizer.decode(tokens)


def test_a_flush_sends_no_delta_shorter_than_the_stream_interval(tokenizer):
    """With `stream_interval`, a flush sends held tokens only once there are enough (the
    first delta too: it waits for its tokens, not for a flush)."""
    tokens = tokenizer.encode("a b c d e f g h i j")
    events = feed(tokenizer, make_request(interval=3), tokens, flushes={1, 4, 6})
    assert [len(d.tokens) for d in events if isinstance(d, Delta)] == [3, 4, len(tokens) - 7]


def test_timing_counts_from_arrival(tokenizer):
    """queued, TTFT and total are measured from the entry's arrival."""
    tokens = tokenizer.encode("x y z")
    events = feed(tokenizer, make_request(), tokens)
    # arrived at 100.0, admitted at 100.5, token i at 101.0 + i
    assert events[-1].timing == Timing(queued_ms=500.0, ttft_ms=1000.0, total_ms=1000.0 * len(tokens),
                                       itl_ms=1000.0, tok_s=1.0)


def test_process_step_drops_tokens_of_removed_sequences(tokenizer):
    """A token for a uid no longer running (cancelled this step) is ignored."""
    streams = {7: RequestOutput(make_request(max_tokens=2), tokenizer.detokenizer, 100.0)}
    outgoing, finished = process_step(streams, [TokenOut(7, 50, None), TokenOut(8, 51, None)], now=101.0)
    assert [o.event.id for o in outgoing] == ["r1"] and finished == []
    outgoing, finished = process_step(streams, [TokenOut(7, 52, "length")], now=102.0)
    assert finished == [7] and isinstance(outgoing[-1].event, Done)


def test_tokens_after_a_stop_in_the_same_step_are_dropped(tokenizer):
    """A speculative step gives a sequence several tokens; a stop token among them ends it
    there, once, and what follows it in the step is not output."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    request = replace(make_request(), stopping=Stopping(100, stop_tokens=frozenset([eos])))
    streams = {3: RequestOutput(request, tokenizer.detokenizer, 100.0)}
    hello = tokenizer.encode("hello")
    step = [TokenOut(3, t, None) for t in [*hello, eos, *tokenizer.encode(" world")]]
    outgoing, finished = process_step(streams, step, now=101.0)
    done = outgoing[-1].event
    assert finished == [3] and isinstance(done, Done) and done.text == "hello"
    assert sum(isinstance(o.event, Done) for o in outgoing) == 1


def test_a_request_whose_output_fails_ends_alone_with_an_error(tokenizer):
    """If turning one request's tokens into text raises, that request gets one `internal` error; others go on."""
    class Broken:
        text = ""

        def add_token(self, token: int) -> None:
            raise UnicodeError("broken")

    streams = {1: RequestOutput(make_request(), Broken(), 100.0),
               2: RequestOutput(make_request(), tokenizer.detokenizer, 100.0)}
    outgoing, finished = process_step(streams, [TokenOut(1, 50, None), TokenOut(2, 50, None)], now=101.0)
    assert finished == [1]
    assert [type(o.event).__name__ for o in outgoing] == ["Error", "Delta"]
    assert outgoing[0].event.code == "internal"
