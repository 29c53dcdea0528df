"""The wire format, with no worker: what producers and readers rely on."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import msgpack
import pytest
from support import ROOT

from client import Delta, Done, Error, TokenLogprob, TopLogprob, decode_event, encode_event, encode_request
from client.protocol import RequestRejected, Timing, Undeliverable, Usage, read_envelope, validate_body
from client.replies import stream_entries


@pytest.mark.parametrize("event", [
    Delta(id="a", seq=0, text="héllo", tokens=[1, 2]),
    Delta(id="a", seq=2, text="", tokens=[5], reasoning="hmm"),
    Delta(id="a", seq=1, text=" yes", tokens=[7], logprobs=[TokenLogprob(
        token_id=7, text=" yes", logprob=-0.25, top_logprobs=[TopLogprob(token_id=7, text=" yes", logprob=-0.25),
                                                              TopLogprob(token_id=9, text=" no", logprob=-1.5)])]),
    Done(id="a", finish_reason="stop", text="x", usage=Usage(prompt_tokens=1, completion_tokens=1, cached_tokens=0),
         timing=Timing(queued_ms=1.0, ttft_ms=None, total_ms=2.0, itl_ms=None, tok_s=None), metadata={"k": [1]}),
    Error(id="a", code="invalid_request", message="bad"),
])
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_events_round_trip(event, encoding):
    """Every event type survives encoding and decoding in both formats."""
    fields = encode_event(event, encoding)
    assert fields["type"] == event.type and encoding in fields
    wire = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    assert decode_event(wire) == event


def test_event_json_is_plain_for_other_languages():
    """A JSON event body is a flat object any language can read."""
    fields = encode_event(Delta(id="a", seq=3, text="t", tokens=[9]), "json")
    assert json.loads(fields["json"]) == {"id": "a", "seq": 3, "text": "t", "tokens": [9]}
    fields = encode_event(Delta(id="a", seq=4, text="", tokens=[2], reasoning="so"), "json")
    assert json.loads(fields["json"]) == {"id": "a", "seq": 4, "text": "", "tokens": [2], "reasoning": "so"}


def test_request_envelope_reads_id_reply_to_and_encoding():
    """The envelope picks the output stream and encoding even before validation."""
    env = read_envelope({b"id": b"r-1", b"msgpack": msgpack.packb({"prompt": "x", "reply_to": "mine"})})
    assert (env.id, env.reply_to, env.encoding, env.error) == ("r-1", "mine", "msgpack", None)
    env = read_envelope({b"id": b"r-2", b"json": b'{"prompt": "x", "encoding": "msgpack"}'})
    assert env.encoding == "msgpack"


@pytest.mark.parametrize("fields", [{}, {b"id": b""}, {b"id": b"a b"}, {b"id": b"\xff"}])
def test_entry_without_a_valid_id_is_undeliverable(fields):
    """No id, an empty one, bad characters or bad bytes: the entry cannot be answered."""
    with pytest.raises(Undeliverable):
        read_envelope({**fields, b"json": b"{}"})


def test_validation_errors_name_every_bad_field():
    """One message lists each bad field with its reason."""
    with pytest.raises(RequestRejected) as error:
        validate_body({"prompt": "x", "max_tokens": 0, "top_p": 2, "colour": "red"})
    message = str(error.value)
    assert "max_tokens: Input should be greater than or equal to 1" in message
    assert "top_p: Input should be less than or equal to 1" in message
    assert "colour: Extra inputs are not permitted" in message


def test_strict_types_do_not_coerce():
    """Strings are not silently turned into numbers, nor numbers into strings."""
    for body in ({"prompt": "x", "max_tokens": "5"}, {"prompt": 5}, {"prompt": "x", "seed": True},
                 {"prompt": "x", "speculative": "no"}, {"prompt": "x", "speculative": 0}):
        with pytest.raises(RequestRejected):
            validate_body(body)
    assert validate_body({"prompt": "x", "temperature": 1}).temperature == 1.0
    assert validate_body({"prompt": "x", "speculative": False}).speculative is False


def test_encode_request_checks_the_id():
    """The producer helper refuses ids the worker could not answer."""
    assert encode_request("ok-1", {"prompt": "x"}) == {"id": "ok-1", "json": b'{"prompt":"x"}'}
    with pytest.raises(RequestRejected):
        encode_request("not ok", {"prompt": "x"})


def test_stream_replies_are_the_same_in_resp2_and_resp3():
    """XREAD replies of both protocol versions normalise to the same entries."""
    entries = [(b"1-0", {b"a": b"1"}), (b"2-0", {b"a": b"2"})]
    assert stream_entries([[b"k", entries]]) == stream_entries({b"k": [entries]}) == [
        ("1-0", {b"a": b"1"}), ("2-0", {b"a": b"2"})]
    assert stream_entries(None) == stream_entries([]) == []


def test_client_imports_without_mlx():
    """`import client` works where MLX cannot be imported at all."""
    script = textwrap.dedent("""
        import sys
        class NoMlx:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("mlx", "mlx_lm", "worker"):
                    raise ImportError(f"{name} is not installed here")
        sys.meta_path.insert(0, NoMlx())
        import client
        client.Client("redis://127.0.0.1:1")
        client.encode_request("a", {"prompt": "x"})
        assert not [m for m in sys.modules if m.startswith("mlx")]
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr
