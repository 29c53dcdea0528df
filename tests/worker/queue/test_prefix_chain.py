"""A request's prefix chain (common/prefix_chain.py) names the start of its prompt alone:
what lies past the chain's bytes, in a prompt or in one long message, changes nothing."""

from __future__ import annotations

from common.prefix_chain import BLOCK_BYTES, CHAIN_BYTES, MAX_BLOCKS, prefix_chain, worth_sharing


def _chat(text: str) -> dict:
    return {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "And?"}]}


def test_only_the_start_of_a_long_message_names_the_chain():
    shared = "queues " * (CHAIN_BYTES // 7 + 100)  # past the chain's bytes
    long_a, long_b = prefix_chain(_chat(shared + "one ending")), prefix_chain(_chat(shared + "another"))
    assert len(long_a) == MAX_BLOCKS and long_a == long_b
    early = prefix_chain(_chat(shared[:1000] + "X" + shared[1001:]))
    assert early[:1000 // BLOCK_BYTES] == long_a[:1000 // BLOCK_BYTES] and early[-1] != long_a[-1]


def test_a_long_prompt_and_its_tokens_name_their_start_alone():
    text = "x" * (CHAIN_BYTES + 5000)
    assert prefix_chain({"prompt": text}) == prefix_chain({"prompt": text[:CHAIN_BYTES] + "y" * 99})
    tokens = list(range(CHAIN_BYTES))
    assert prefix_chain({"prompt_tokens": tokens}) == prefix_chain({"prompt_tokens": tokens[:CHAIN_BYTES // 4 + 1]})


def test_a_prompt_is_worth_waiting_for_only_when_it_shares_most_of_its_start():
    """A system prompt shared whole is worth waiting for or copying; a common short header
    (one block), or a shared part under half of the prompt, is cheaper to compute again."""
    system = "You answer for the payments team, citing the runbook. " * 20  # ~1 KB: four blocks
    a, b = prefix_chain(_chat(system + "Who owns refunds?")), prefix_chain(_chat(system + "Why the retry?"))
    assert worth_sharing(a, b) and worth_sharing(b, a)
    header = "You are a helpful assistant. " * 9 + "Then: "  # one block in common, then apart
    c, d = prefix_chain(_chat(header + "a" * 1500)), prefix_chain(_chat(header + "b" * 1500))
    assert c[:1] == d[:1] and not worth_sharing(c, d)
    long = prefix_chain(_chat(system + "q" * 3000))  # shares its first four blocks of sixteen
    assert not worth_sharing(long, a) and worth_sharing(a, long), "half of the asking prompt's own chain"
