"""The prefix cache's SSD tier (`ssd_cache_dir`): a restarted worker's first request on a
long prompt is a hit read from disk, and nothing on disk can break a worker or answer
for another model: corrupt and half-written files are dropped, another model's files
are never read, the tier keeps to its budget, two workers on one host keep apart."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
from support import build_demo_model, check_stream, heartbeat_stats, start_worker, wait_for, worker_url, xadd_json

from client import Delta, Done

# 25 of mlx-vlm's 16-token blocks and 7 tokens more: mlx-vlm 0.7.10's disk lookup matches
# the whole prompt, and a match of all of it is not used (one token must be prefilled),
# so a prompt of whole blocks is never a disk hit.
LONG = random.Random(5).choices(range(10, 1000), k=407)


def serve(redis_url: str, model: Path, tier: Path, logs_dir: Path, **settings):
    return start_worker(worker_url(redis_url), model, f"ssd{uuid.uuid4().hex[:8]}", logs_dir, ssd_cache_dir=tier,
                        cache_memory_mb=64, **settings)


def ask(worker, r, outputs, prompt: list[int]) -> tuple[list[int], int]:
    """The prompt's greedy tokens, and how many of its tokens the worker found cached."""
    rid = f"ssd-{uuid.uuid4().hex[:8]}"
    xadd_json(r, worker.queue, rid, {"prompt_tokens": prompt, "max_tokens": 12, "ignore_eos": True})
    events = outputs.of(rid)
    done = check_stream(events)
    assert isinstance(done, Done), events
    return [t for e in events if isinstance(e, Delta) for t in e.tokens], done.usage.cached_tokens


def shards(tier: Path) -> list[Path]:
    return sorted(tier.glob("slot-*/*/*.safetensors"))


def warm(redis_url, model, tier, logs_dir, r, outputs, **settings) -> list[int]:
    """Serve LONG once and stop when its blocks are on disk; its tokens."""
    worker = serve(redis_url, model, tier, logs_dir, **settings)
    tokens, cached = ask(worker, r, outputs, LONG)
    assert cached == 0
    wait_for(lambda: shards(tier), what="the prompt's blocks on disk")
    worker.stop()
    assert worker.process.returncode == 0, worker.log()
    return tokens


def test_a_restarted_worker_reads_the_prompt_from_disk(redis_url, demo_model, tmp_path, logs_dir, r, outputs):
    cold = warm(redis_url, demo_model, tmp_path, logs_dir, r, outputs)
    worker = serve(redis_url, demo_model, tmp_path, logs_dir)
    try:
        tokens, cached = ask(worker, r, outputs, LONG)
        assert cached == 400 and tokens == cold  # its whole blocks
        tier = wait_for(lambda: (heartbeat_stats(r, worker.consumer).get("ssd_cache") or {}).get("hits", 0) > 0
                        and heartbeat_stats(r, worker.consumer)["ssd_cache"], what="the hit in the heartbeat")
        assert tier["entries"] >= 25
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    """The demo model whose heads (64 wide) mx.quantize can group."""
    return build_demo_model(tmp_path_factory.mktemp("model") / "bench", "--size", "bench")


def test_quantized_entries_come_back_from_disk_as_they_were(redis_url, bench_model, tmp_path, logs_dir, r, outputs):
    """With kv_bits from the first token the tier holds the batch's own codes
    (`packed_prefix`): a restarted worker's hit decodes exactly as the cold run did."""
    cold = warm(redis_url, bench_model, tmp_path, logs_dir, r, outputs, kv_bits=4)
    worker = serve(redis_url, bench_model, tmp_path, logs_dir, kv_bits=4)
    try:
        assert ask(worker, r, outputs, LONG) == (cold, 400)
    finally:
        worker.stop()


def test_another_model_never_reads_the_files(redis_url, demo_model, tmp_path, logs_dir, r, outputs):
    from mlxq import demo_model as builder

    warm(redis_url, demo_model, tmp_path, logs_dir, r, outputs)
    other = builder.build(tmp_path / "models" / demo_model.name, seed=1)  # same name and shape, other weights
    worker = serve(redis_url, other, tmp_path, logs_dir)
    try:
        assert ask(worker, r, outputs, LONG)[1] == 0
    finally:
        worker.stop()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_file_is_a_miss_not_a_crash(redis_url, demo_model, tmp_path, logs_dir, r, outputs, damage):
    cold = warm(redis_url, demo_model, tmp_path, logs_dir, r, outputs)
    damaged = {}
    for shard in shards(tmp_path):
        data = shard.read_bytes()
        damaged[shard] = b"\x00garbage" * 64 if damage == "garbage" else data[: len(data) // 2]
        shard.write_bytes(damaged[shard])
    worker = serve(redis_url, demo_model, tmp_path, logs_dir)
    try:
        tokens, _ = ask(worker, r, outputs, LONG)
        assert tokens == cold
        assert ask(worker, r, outputs, [11, 12, 13])[0]  # still serving
        # Removed at start (the same prompt's blocks may since be written there again, whole).
        assert all(not shard.exists() or shard.read_bytes() != data for shard, data in damaged.items())
    finally:
        worker.stop()
    assert worker.process.returncode == 0, worker.log()


def test_a_half_written_file_is_removed_at_start(redis_url, demo_model, tmp_path, logs_dir, r, outputs):
    """What a kill -9 mid-write leaves: a temporary file, never renamed into place."""
    warm(redis_url, demo_model, tmp_path, logs_dir, r, outputs)
    (shard,) = shards(tmp_path)[:1]
    partial = shard.parent / f"{shard.stem}.deadbeef{shard.suffix}"
    partial.write_bytes(shard.read_bytes()[:100])
    worker = serve(redis_url, demo_model, tmp_path, logs_dir)
    try:
        assert ask(worker, r, outputs, LONG)[1] > 0 and not partial.exists()
    finally:
        worker.stop()


def test_the_tier_keeps_to_its_budget(redis_url, demo_model, tmp_path, logs_dir, r, outputs):
    budget_gb = 0.0005  # ~530 kB: a few prompts' blocks
    worker = serve(redis_url, demo_model, tmp_path, logs_dir, ssd_cache_max_gb=budget_gb)
    try:
        for seed in range(8):
            ask(worker, r, outputs, random.Random(100 + seed).choices(range(10, 1000), k=407))
        wait_for(lambda: len(shards(tmp_path)) >= 2, what="several prompts on disk")
    finally:
        worker.stop()
    assert sum(s.stat().st_size for s in shards(tmp_path)) <= budget_gb * 2**30


def test_two_workers_on_one_host_keep_apart(redis_url, demo_model, tmp_path, logs_dir, r, outputs):
    first = serve(redis_url, demo_model, tmp_path, logs_dir)
    second = serve(redis_url, demo_model, tmp_path, logs_dir)
    try:
        ask(first, r, outputs, LONG)
        ask(second, r, outputs, LONG[::-1])
        wait_for(lambda: {s.parts[-3] for s in shards(tmp_path)} == {"slot-0", "slot-1"},
                 what="each worker's blocks in its own slot")
    finally:
        first.stop()
        second.stop()
    assert first.process.returncode == 0 and second.process.returncode == 0


def test_without_a_memory_tier_it_is_refused(demo_model, tmp_path):
    from worker.engine.backends import load_model
    from worker.settings import load_settings

    with pytest.raises(ValueError, match="cache_memory_mb 0"):
        load_model(load_settings(model=str(demo_model), ssd_cache_dir=tmp_path, cache_memory_mb=0))


def test_files_are_keyed_by_the_kv_quantization_too(demo_model, tmp_path):
    """Blocks stored under one quantization are another model's to a worker with another:
    other bits, group or quantized_kv_start, or packed codes against dense blocks, never
    read them (dense blocks and a start of 0 key as before either existed, so a worker's
    tier of dense blocks survives the upgrade)."""
    from worker.engine.backends.ssd_tier import open_store

    def namespace(packed: bool = False, **quantization) -> str:
        return open_store(tmp_path, demo_model, 1 << 20, quantization, packed=packed).dir.name  # slot-N/<namespace>

    plain, eight = namespace(), namespace(bits=8, group_size=64)
    assert len({plain, eight, namespace(bits=4, group_size=64), namespace(bits=8, group_size=32),
                namespace(bits=8, group_size=64, quantized_kv_start=100),
                namespace(True, bits=8, group_size=64)}) == 6
    assert namespace(bits=8, group_size=64, quantized_kv_start=0) == eight


def test_damaged_files_are_told_from_whole_ones_whatever_their_header_says(tmp_path):
    import json
    import struct

    from worker.engine.backends.ssd_tier import damaged_files

    def write(name: str, header: object, payload: bytes = b"\0" * 16, size: int | None = None) -> None:
        raw = json.dumps(header).encode()
        (tmp_path / "ns").mkdir(exist_ok=True)
        (tmp_path / "ns" / name).write_bytes(struct.pack("<Q", len(raw) if size is None else size) + raw + payload)

    write("whole.safetensors", {"k0": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": {}})
    write("short.safetensors", {"k0": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})
    write("odd-offsets.safetensors", {"k0": {"data_offsets": ["0", "x"]}})
    write("a-list.safetensors", [1, 2, 3])
    write("huge-header.safetensors", {}, size=2**62)
    (tmp_path / "ns" / "empty.safetensors").write_bytes(b"")
    assert sorted(p.name for p in damaged_files(tmp_path)) == [
        "a-list.safetensors", "empty.safetensors", "huge-header.safetensors", "odd-offsets.safetensors",
        "short.safetensors"]
