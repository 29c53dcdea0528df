"""Video TTFT with and without the vision-embedding cache, and a mixed batch's throughput.

    python docs/media_bench.py ttft REDIS_URL QUEUE      # new videos vs one repeated video
    python docs/media_bench.py mixed REDIS_URL QUEUE     # text alone vs text, images and videos

Videos are 2 s of 64x48 noise at 8 fps (4 frames sampled at 2 fps), written by OpenCV;
images 224x224 PNG noise, each new. One request at a time for TTFT; 48 requests, 16 at a
time, 64 tokens each for throughput.
"""

from __future__ import annotations

import asyncio
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from client import AsyncClient, Client

N, REQUESTS, CONCURRENCY, OUTPUT = 20, 48, 16, 64


def mp4(seed: int) -> bytes:
    import cv2

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, (64, 48))
        for i in range(16):
            writer.write((np.random.RandomState(seed * 100 + i).rand(48, 64, 3) * 255).astype(np.uint8))
        writer.release()
        return path.read_bytes()


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(224, 224, 3) * 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def ttft(url: str, queue: str) -> None:
    with Client(url, queue=queue) as client:
        def one(video: bytes) -> float:
            return client.generate("What happens?", videos=[video], max_tokens=4, timeout=60).timing.ttft_ms

        one(mp4(999))  # warm up
        fresh = [one(mp4(seed)) for seed in range(N)]
        same = mp4(12345)
        one(same)
        repeat = [one(same) for _ in range(N)]
    print(f"{queue}: new video TTFT p50 {statistics.median(fresh):.1f} ms, "
          f"repeated video p50 {statistics.median(repeat):.1f} ms")


async def _throughput(url: str, queue: str, media: list[dict]) -> float:
    async with AsyncClient(url, queue=queue) as client:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(k: int) -> int:
            async with gate:
                done = await client.generate(f"Tell me about request {k}", max_tokens=OUTPUT, ignore_eos=True,
                                             timeout=300, **media[k])
                return done.usage.completion_tokens

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(k) for k in range(REQUESTS)))
        return sum(tokens) / (time.perf_counter() - start)


def mixed(url: str, queue: str) -> None:
    text = asyncio.run(_throughput(url, queue, [{}] * REQUESTS))
    # Each image and video new (no cache hits): a third of the requests each kind.
    kinds = [{} if k % 3 == 0 else {"images": [png(k)]} if k % 3 == 1 else {"videos": [mp4(k)]}
             for k in range(REQUESTS)]
    both = asyncio.run(_throughput(url, queue, kinds))
    print(f"{queue}: text alone {text:.0f} tok/s; a third each text, image, video {both:.0f} tok/s "
          f"({both / text:.2f} of text alone)")


if __name__ == "__main__":
    {"ttft": ttft, "mixed": mixed}[sys.argv[1]](sys.argv[2], sys.argv[3])
