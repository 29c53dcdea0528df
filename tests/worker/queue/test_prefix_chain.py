"""A request's prefix chain (common/prefix_chain.py) names the start of its prompt alone:
what lies past the chain's bytes, in a prompt or in one long message, changes nothing."""

from __future__ import annotations

from common.prefix_chain import BLOCK_BYTES, CHAIN_BYTES, MAX_BLOCKS, prefix_chain


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
