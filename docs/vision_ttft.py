"""TTFT of image requests, new images vs one repeated image, one request at a time.

Run against a worker with the vision cache and one with --vision-cache-mb 0:
    python docs/vision_ttft.py REDIS_URL QUEUE
"""

import io
import statistics
import sys

import numpy as np
from PIL import Image

from client import Client

N = 20


def png(width: int, height: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def ttft(client: Client, image: bytes) -> float:
    return client.generate("Describe", images=[image], max_tokens=4, timeout=60).timing.ttft_ms


def main(url: str, queue: str) -> None:
    with Client(url, queue=queue) as client:
        ttft(client, png(64, 64, 999))  # warm up
        fresh = [ttft(client, png(224, 224, seed)) for seed in range(N)]
        same = png(224, 224, 12345)
        ttft(client, same)
        repeat = [ttft(client, same) for _ in range(N)]
    print(f"{queue}: new image TTFT p50 {statistics.median(fresh):.1f} ms, "
          f"repeated image p50 {statistics.median(repeat):.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
