"""The prefix cache's SSD tier: where on disk a worker keeps its blocks, keyed by what.

mlx-vlm's `DiskBlockStore` does the work: every block its prefix cache stores is also
written to disk by a background thread (a temporary file renamed into place, so a kill
mid-write leaves only a partial that the next start deletes), shards over the budget are
evicted oldest first, and the index is rebuilt from the files at start, so a restarted
worker's first request on a long shared prompt is a hit. A file whose header does not
parse or whose tensors run past its end is removed before that (`damaged_files`).
Ours is the key and the place:

- the namespace (a subdirectory) fingerprints the model's weights, not only its path: a
  sample of every weight file's bytes and its size, with the config and the KV
  quantization, so another model, or the same path with other weights, never reads
  these files;
- each worker process on a host takes a slot of its own (`slot-N`, held by an exclusive
  lock on `slot-N.lock` for the process's life, released by the kernel however it dies),
  so two workers never write or evict one directory; a restarted worker takes the lowest
  free slot, the one it had when it ran alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

MAX_SLOTS = 64
SAMPLES = 16  # chunks hashed per weight file, spread over it
SAMPLE_BYTES = 1 << 16

_held: list[int] = []  # the slot locks' descriptors: held until the process ends


def open_store(root: Path, model_dir: Path, max_bytes: int, kv_quantization: dict[str, Any], *,
               packed: bool) -> Any:
    """mlx-vlm's disk block store for this model, in a slot of `root` no other live worker holds;
    `packed`: its blocks hold quantized codes (`packed_prefix`), never read as dense ones."""
    from mlx_vlm.apc import DiskBlockStore, apc_disk_namespace

    slot = claim_slot(root)
    for damaged in damaged_files(slot):
        damaged.unlink(missing_ok=True)
    entries = "+packed" if packed else ""  # dense entries' namespace as before, so those tiers survive an upgrade
    namespace = apc_disk_namespace(model_dir.name[:64], weights_fingerprint=weights_fingerprint(model_dir) + entries,
                                   kv_bits=kv_quantization.get("bits"),
                                   kv_group_size=kv_quantization.get("group_size"),
                                   quantized_kv_start=kv_quantization.get("quantized_kv_start") or None)
    return DiskBlockStore(slot, namespace=namespace, max_bytes=max_bytes)


def claim_slot(root: Path) -> Path:
    """The lowest `root/slot-N` whose lock this process could take."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(MAX_SLOTS):
        descriptor = os.open(root / f"slot-{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue
        _held.append(descriptor)
        return root / f"slot-{n}"
    raise RuntimeError(f"ssd_cache_dir {root}: all {MAX_SLOTS} slots are held by live workers")


def damaged_files(slot: Path) -> list[Path]:
    """The slot's safetensors files whose header does not parse or whose tensors run past
    the end of the file (cut short: a full disk, a copy stopped halfway). mlx-vlm drops
    an unreadable header itself, but keeps a cut-short file and fails to load it on every
    hit; these are removed before its index is built."""
    damaged = []
    for path in slot.glob("*/*.safetensors"):
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                header_size = struct.unpack("<Q", f.read(8))[0]
                if not 0 < header_size <= size - 8:
                    raise ValueError("no header of that size fits")
                header = json.loads(f.read(header_size))
            ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
            whole = 8 + header_size + max(ends, default=0) <= size
        except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError):
            whole = False  # unreadable, or not a safetensors header
        if not whole:
            damaged.append(path)
    return damaged


def weights_fingerprint(model_dir: Path) -> str:
    """A digest of the model's config and weights: each weight file's size and SAMPLES
    chunks of its bytes (a whole 40 GB model is not read at start; two checkpoints of one
    shape differ in nearly every chunk)."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            for i in range(SAMPLES):
                f.seek(size * i // SAMPLES)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]
