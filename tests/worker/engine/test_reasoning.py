"""Reasoning: on a thinking model, the text between <think> and </think> goes to
`reasoning` (deltas and done), never into `text`; a response_format applies to the
answer after it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support import Outputs, check_stream, worker_fixture

from client import Delta, Done

THINK, END_THINK = 3, 4  # the thinking demo model's <think> and </think> (checked below)
ASK = [{"role": "user", "content": "Think first."}]


worker = worker_fixture("thinking_model", redis="valkey")


def test_the_model_knows_its_think_tokens(thinking_model):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(thinking_model)
    assert tokenizer.has_thinking and tokenizer.think_start_tokens == (THINK,)
    assert tokenizer.think_end_tokens == (END_THINK,)


def test_reasoning_never_mixes_into_the_text(client, r):
    """The template opens the reasoning: all the output is reasoning (</think> barred
    here), streamed in deltas' `reasoning`, joined in done's; `text` stays empty."""
    job = client.submit(messages=ASK, max_tokens=16, logit_bias={str(END_THINK): -100})
    events = Outputs(r).of(job.id)
    done = check_stream(events)
    assert isinstance(done, Done) and done.text == "" and done.reasoning
    deltas = [e for e in events if isinstance(e, Delta)]
    assert all(d.text == "" for d in deltas)
    assert "".join(d.reasoning for d in deltas) == done.reasoning


def test_thinking_off_gives_an_answer_without_reasoning(client):
    done = client.generate(messages=ASK, max_tokens=12, chat_template_kwargs={"enable_thinking": False},
                           logit_bias={str(THINK): -100}, timeout=60)
    assert done.text and done.reasoning == ""


def test_a_format_applies_to_the_answer_after_the_reasoning(client):
    """</think> pushed first (+100): the reasoning ends at once and the answer follows the
    format, the bias notwithstanding."""
    done = client.generate(messages=ASK, max_tokens=20, logit_bias={str(END_THINK): 100},
                           response_format={"type": "choice", "choices": ["alpha", "beta"]}, timeout=60)
    assert done.reasoning == "" and done.text in ("alpha", "beta") and done.finish_reason == "stop"


def test_the_guided_processor_waits_for_the_reasoning_to_end(thinking_model):
    """Unit: inside the reasoning the logits pass untouched; after </think> they are masked
    to the format; before the first token, the reasoning may still start."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from client.protocol import ChoiceFormat
    from worker.engine.constraints import Grammars, Guides, format_grammar
    from worker.messages import Thinking

    grammars, guides = Grammars(load_tokenizer(thinking_model), 1024), Guides(1024, 2)
    choice = ChoiceFormat(type="choice", choices=["alpha"])
    logits = mx.random.normal((1, 1024))
    inside = guides.processor(grammars.matcher(format_grammar(choice), []), 3, [0, 2],
                              Thinking(THINK, END_THINK, open=True))
    assert mx.array_equal(inside(mx.array([1, 2, 3, 50, 60]), logits), logits)
    masked = inside(mx.array([1, 2, 3, 50, 60, END_THINK]), logits)
    assert int(mx.isfinite(masked).sum().item()) < 1024
    before = guides.processor(grammars.matcher(format_grammar(choice), []), 3, [0, 2],
                              Thinking(THINK, END_THINK, open=False))(mx.array([1, 2, 3]), logits)
    assert before[0, THINK].item() == logits[0, THINK].item()
    assert int(mx.isfinite(before).sum().item()) < 1024


def test_a_resumed_output_keeps_reasoning_and_text_apart(thinking_model):
    """Unit: tokens [r1 r2 </think> a1 a2] split into reasoning and text; a delivery that
    resumes after [r1 r2 </think> a1] sends only what is new of each, and done has both whole."""
    from mlx_lm.utils import load_tokenizer

    from worker.engine.backends import TokenOut
    from worker.engine.output import RequestOutput
    from worker.messages import (
        EngineRequest,
        Queueing,
        Reporting,
        RequestRef,
        Resume,
        SamplingParams,
        Stopping,
        Thinking,
    )

    tokenizer = load_tokenizer(thinking_model)
    r1, r2, a1, a2 = 300, 301, 400, 401
    request = EngineRequest(ref=RequestRef("t", "1-0"), prompt_tokens=[1, 2, THINK], sampling=SamplingParams(),
                            stopping=Stopping(10), queueing=Queueing(0, 0.0),
                            reporting=Reporting(thinking=Thinking(THINK, END_THINK, open=True)))
    whole = RequestOutput(request, tokenizer.detokenizer, 0.0, tokenizer.detokenizer)
    events = [e for i, t in enumerate([r1, r2, END_THINK, a1, a2])
              for e in whole.add(TokenOut(0, t, "length" if i == 4 else None), now=1.0)]
    done = events[-1]
    assert done.reasoning == detokenized(tokenizer, [r1, r2]) and done.text == detokenized(tokenizer, [a1, a2])
    earlier = [e for e in events[:-1] if e.seq < 4]
    resume = Resume(tokens=[t for d in earlier for t in d.tokens], text="".join(d.text for d in earlier), deltas=4,
                    reasoning="".join(d.reasoning for d in earlier))
    resumed = RequestOutput(replace(request, resume=resume), tokenizer.detokenizer, 0.0, tokenizer.detokenizer)
    rest = resumed.add(TokenOut(0, a2, "length"), now=2.0)
    assert "".join(d.text for d in [*earlier, *rest[:-1]]) == rest[-1].text == done.text
    assert "".join(d.reasoning for d in [*earlier, *rest[:-1]]) == rest[-1].reasoning == done.reasoning


def detokenized(tokenizer, tokens: list[int]) -> str:
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.parametrize(("opened", "tokens", "inside", "answer"), [
    (True, [300, 301], True, []),
    (True, [300, END_THINK, 400], False, [400]),
    (False, [THINK, 300], True, []),
    (False, [400, THINK, 401], False, [400, THINK, 401]),  # after the answer starts, a marker is text
    (False, [THINK, 300, END_THINK, 400, END_THINK], False, [400, END_THINK]),
])
def test_where_a_resumed_output_stands(opened, tokens, inside, answer):
    """Unit: the rule the intake's matcher and the engine's mask share (the output follows it token by token)."""
    from worker.messages import Thinking

    assert Thinking(THINK, END_THINK, open=opened).after(tokens) == (inside, answer)
