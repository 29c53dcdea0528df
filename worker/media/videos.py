"""A request's video bytes turned into sampled frames, in the decoder's own process (`isolated`).

The container's header is read first (OpenCV: frame count, rate, size), and a video
longer than `max_video_seconds` or with frames larger than `max_image_pixels` is refused
before any frame is decoded. Frames are then sampled by mlx-vlm's `load_video`, at the
request's rate up to its frame budget, as the model's processor expects them.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
from mlx_vlm.utils import VideoSampling, load_video

from client.protocol import ErrorCode, RequestRejected


@dataclass(frozen=True)
class VideoLimits:
    """What one request's video may be, and how it is sampled."""

    fps: float
    max_frames: int
    max_pixels: int
    max_seconds: float


def decode_video(data: bytes, limits: VideoLimits) -> tuple[np.ndarray, Any]:
    """The sampled frames, (T, C, H, W) uint8, and mlx-vlm's `VideoMetadata` of them."""
    # OpenCV reads containers from files only; the file lives only as long as this call.
    with tempfile.NamedTemporaryFile(suffix=".video") as file:
        file.write(data)
        file.flush()
        capture = cv2.VideoCapture(file.name)
        try:
            if not capture.isOpened():
                raise RequestRejected(f"not a video OpenCV can open ({len(data)} bytes starting {data[:8]!r})")
            _check_header(capture, limits)
        finally:
            capture.release()
        # load_video asks for at least one frame per frame_factor (2): a one-frame clip has
        # too few, which is its error, not a crash.
        frames, metadata = load_video(file.name, VideoSampling(fps=limits.fps, max_frames=limits.max_frames))
    return frames, metadata


def _check_header(capture: Any, limits: VideoLimits) -> None:
    frames = capture.get(cv2.CAP_PROP_FRAME_COUNT)
    rate = capture.get(cv2.CAP_PROP_FPS) or 0.0
    width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if frames <= 0 or rate <= 0 or width <= 0 or height <= 0:
        raise RequestRejected(f"its container gives no frame count, rate or size ({frames:g} frames at "
                              f"{rate:g} fps, {width}x{height})")
    if width * height > limits.max_pixels:
        raise RequestRejected(f"its frames are {width}x{height}, {width * height} pixels; this worker's "
                              f"max_image_pixels is {limits.max_pixels}", code=ErrorCode.TOO_LARGE)
    seconds = frames / rate
    if seconds > limits.max_seconds:
        raise RequestRejected(f"{frames:g} frames at {rate:g} fps is {seconds:g} s; this worker's "
                              f"max_video_seconds is {limits.max_seconds:g}", code=ErrorCode.TOO_LARGE)
