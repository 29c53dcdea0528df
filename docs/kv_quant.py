"""Quantized KV cache in mlx-vlm's batch: KV bytes per token of a sequence, tok/s at 16
and how long greedy output agrees with the unquantized cache, by `kv_bits`.

    python -m mlxq.blas .venv/bin/python docs/kv_quant.py MODEL [--prompts 16] [--input-len 100] [--output-len 128]
        [--group 64] [--code] [--start N]

Runs mlx-vlm's BatchGenerator (the one a worker with `kv_bits` runs) in this process on
the model's language model, the prompts inserted together, greedy, no stops; the first
pass of each setting warms up and is not counted. Random prompts over the vocabulary,
or with `--code` windows of the standard library's sources (for `mlxq demo-model --trained`).
With `--start N`, each quantized setting again with `quantized_kv_start` N (the batch runs
dense and the worker's `QuantizeFrom` switches it between steps, as in a worker).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


class NoStops:
    eos_token_ids: list[int] = []

    def add_eos_token_ids(self, ids: Any = None) -> None: ...

    def reset(self, ids: Any = None) -> None: ...

    def __call__(self, token: Any) -> bool:
        return False


def run(model: Any, processor: Any, prompts: list[list[int]], new_tokens: int, bits: int | None,
        group: int, start: int = 0) -> tuple[list[list[int]], float, float]:
    """Each prompt's tokens, the batch's tok/s, and its KV bytes per token of one sequence."""
    from mlx_vlm.generate.ar import BatchGenerator

    from worker.engine.backends.kv_start import QuantizeFrom

    quantized = {} if bits is None or start else {"kv_bits": bits, "kv_group_size": group}
    switch = QuantizeFrom(start, bits, group) if bits is not None and start else None
    batch = BatchGenerator(model.language_model, processor, compute_logprobs=False, completion_batch_size=64,
                           prefill_batch_size=len(prompts), prefill_step_size=4096, **quantized)
    embeddings = [{k: v for k, v in model.get_input_embeddings(mx.array([p])).to_dict().items() if v is not None}
                  for p in prompts]
    uids = batch.insert(prompts, [new_tokens] * len(prompts), prompt_kwargs=embeddings)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    per_token = 0.0
    start = time.perf_counter()
    while any(len(made) < new_tokens for made in tokens.values()):
        for response in batch.next()[1]:
            tokens[response.uid].append(response.token)
        if switch is not None:
            switch.after_step(batch._generation_batch)
        if all(len(made) == new_tokens - 1 for made in tokens.values()):  # the cache at its fullest
            per_token = kv_bytes_per_token(batch, len(prompts[0]) + new_tokens - 1, len(prompts))
    elapsed = time.perf_counter() - start
    batch.close()
    return [tokens[uid] for uid in uids], len(prompts) * new_tokens / elapsed, per_token


def kv_bytes_per_token(batch: Any, length: int, rows: int) -> float:
    """Bytes the running batch's caches hold per token of one sequence (their arrays are
    allocated in steps of 256 tokens, so this is what the tokens held use, not the slack)."""
    caches = batch._generation_batch.prompt_cache
    held = sum(array.nbytes for cache in caches for _, array in tree_flatten(cache.state))
    return held / rows / length


def agreement(reference: list[list[int]], other: list[list[int]]) -> list[int]:
    """Per prompt, the tokens generated before the first that differs."""
    out = []
    for a, b in zip(reference, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        out.append(same)
    return out


def main() -> None:
    from mlx_vlm import load

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--code", action="store_true", help="prompts cut from the standard library's sources "
                        "(what the trained demo model learnt) instead of random tokens")
    parser.add_argument("--start", type=int, default=0, help="also each kv_bits with this quantized_kv_start")
    args = parser.parse_args()
    model, processor = load(args.model)
    (processor.tokenizer if hasattr(processor, "tokenizer") else processor).stopping_criteria = NoStops()
    vocab = model.config.vocab_size if hasattr(model.config, "vocab_size") else model.config.text_config.vocab_size
    rng = random.Random(args.seed)
    if args.code:
        from pathlib import Path

        from mlxq.demo_trained import corpus_tokens

        corpus = corpus_tokens(Path(args.model))
        starts = [rng.randrange(len(corpus) - args.input_len) for _ in range(args.prompts)]
        prompts = [corpus[s:s + args.input_len].tolist() for s in starts]
    else:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
    results = {}
    settings = [(None, 0), (8, 0), (4, 0)] + ([(8, args.start), (4, args.start)] if args.start else [])
    for bits, start in settings:
        run(model, processor, prompts[:2], 8, bits, args.group, start)  # warm-up
        tokens, rate, per_token = run(model, processor, prompts, args.output_len, bits, args.group, start)
        results[bits, start] = tokens
        same = sorted(agreement(results[None, 0], tokens))
        print(json.dumps({"kv_bits": bits, "quantized_kv_start": start, "tok_s": round(rate),
                          "kv_bytes_per_token": round(per_token),
                          "kv_mb_per_2k_token_sequence": round(per_token * 2048 / 2**20, 2),
                          "agree_tokens_median": same[len(same) // 2], "agree_tokens_min": same[0],
                          "identical_sequences": sum(s == args.output_len for s in same)}), flush=True)


if __name__ == "__main__":
    main()
