"""How the fleet names a request's prompt prefix: a chain of hashes, one per whole block of
its prompt as sent, each covering everything before its block's end.

The worker that reads a request computes its chain from the raw body, before anything
is tokenized, to find a worker whose prefix cache holds the longest part of it; the
engine keeps each cached entry's chain, and its digest (every hash of the chains it
holds) tells the fleet what it holds. Two requests share the first n hashes exactly
when their bodies share the first n blocks of prompt and everything that goes before
the prompt into the model (the tools, the template's arguments) and into the cache's
namespace (the cache salt, the adapter), so equal hashes mean the same prompt prefix.

Requests with media have no chain: their bytes are not hashed, and two images at the
same place in the same text would look alike.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

BLOCK_BYTES = 256  # about 64 tokens of English; a prefix shorter than this is not worth placing
MAX_BLOCKS = 64  # the first 16 KB of a prompt name it: longer shared prefixes rarely part later
CHAIN_BYTES = BLOCK_BYTES * MAX_BLOCKS
MIN_BLOCKS = 2  # a shared prefix shorter than this (512 bytes) is not worth moving or waiting for
DIGEST_HASHES = 4096  # most hashes a worker's digest lists (32 KB): its most recently used entries' chains
MESSAGE_END = b"\x1e"

Chain = tuple[int, ...]


def prefix_chain(raw: Any) -> Chain:
    """The chain of a request body (as decoded, not yet validated); () for one with media,
    with no whole block of prompt, or that cannot be read."""
    if not isinstance(raw, dict) or any(raw.get(media) for media in ("images", "videos", "audio")):
        return ()
    prompt = _prompt_bytes(raw)
    if prompt is None or len(prompt) < BLOCK_BYTES:
        return ()
    context = {name: raw.get(name) for name in ("cache_salt", "adapter", "tools", "chat_template_kwargs")}
    try:
        seed = json.dumps(context, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError):
        return ()
    digest = hashlib.blake2b(seed, digest_size=8).digest()
    chain = []
    for start in range(0, min(len(prompt) // BLOCK_BYTES, MAX_BLOCKS) * BLOCK_BYTES, BLOCK_BYTES):
        digest = hashlib.blake2b(digest + prompt[start:start + BLOCK_BYTES], digest_size=8).digest()
        chain.append(int.from_bytes(digest, "big") >> 1)  # 63 bits: a signed 64-bit integer anywhere
    return tuple(chain)


def _prompt_bytes(raw: dict[str, Any]) -> bytes | None:
    """The start of the prompt as bytes (what the chain can hold, no more: this runs on the
    worker's event loop), each kind marked apart: text, chat messages (role and text of
    each), token ids; None where it holds anything else."""
    prompt, messages, tokens = raw.get("prompt"), raw.get("messages"), raw.get("prompt_tokens")
    if isinstance(prompt, str) and messages is None and tokens is None:
        return b"p" + prompt[:CHAIN_BYTES].encode("utf-8", "surrogatepass")  # a character is a byte or more
    if isinstance(messages, list) and prompt is None and tokens is None:
        parts, size = [b"m"], 1
        for message in messages:
            text = _message_bytes(message)
            if text is None:
                return None
            parts.append(text + MESSAGE_END)
            size += len(parts[-1])
            if size > CHAIN_BYTES:
                break
        return b"".join(parts)
    if isinstance(tokens, list) and prompt is None and messages is None:
        head = tokens[:CHAIN_BYTES // 4 + 1]
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in head):
            return None
        return b"t" + struct.pack(f"<{len(head)}I", *head)
    return None


def _message_bytes(message: Any) -> bytes | None:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return None
    content = message.get("content")
    if isinstance(content, list):  # parts: text only (a media part has no chain)
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            return None
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        return None
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}  # tool calls, names, ...
    try:
        extra = json.dumps(rest, sort_keys=True, separators=(",", ":")) if rest else ""
    except (TypeError, ValueError):
        return None
    # The chain reads the first CHAIN_BYTES alone: a longer text is cut before it is encoded.
    return f"{message['role']}\x1f{(content or '')[:CHAIN_BYTES]}\x1f{extra}".encode("utf-8", "surrogatepass")


def shared_blocks(a: Chain, b: Chain) -> int:
    """How many leading blocks two chains share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def worth_sharing(chain: Chain, other: Chain) -> bool:
    """Whether a prompt shares enough with another's to wait for its KV or copy it: at
    least `MIN_BLOCKS`, and at least half of its own chain (a common short header, such
    as a chat template's default system line, is cheaper to compute again)."""
    shared = shared_blocks(chain, other)
    return shared >= MIN_BLOCKS and 2 * shared >= len(chain)


def matched_blocks(chain: Chain, held: frozenset[int] | set[int]) -> int:
    """How many leading blocks of `chain` a digest holds (a held hash implies its prefix)."""
    for length in range(len(chain), 0, -1):
        if chain[length - 1] in held:
            return length
    return 0
