"""The media the tests send, made here (offline, deterministic by seed): noise images,
short videos written by OpenCV's FFmpeg, and WAV clips."""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path

import numpy as np
from PIL import Image


def png(width: int = 40, height: int = 40, seed: int = 0) -> bytes:
    """A noise image: every size and seed looks different to the vision tower."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def video(path: Path, frames: int = 12, fps: float = 6.0, size: tuple[int, int] = (64, 48), seed: int = 0) -> bytes:
    """A noise video (mp4v), written at `path` and returned."""
    import cv2

    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    for i in range(frames):
        writer.write((np.random.RandomState(seed * 1000 + i).rand(height, width, 3) * 255).astype(np.uint8))
    writer.release()
    return path.read_bytes()


def wav(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> bytes:
    """A mono 16-bit WAV of noise under a tone."""
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * np.random.RandomState(seed).randn(len(t))
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
