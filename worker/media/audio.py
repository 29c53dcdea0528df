"""A request's audio bytes turned into one channel of samples at the model's rate, in the
decoder's own process (`isolated`).

miniaudio reads WAV, FLAC, MP3 and Ogg Vorbis from memory. The format is told from the
file's first bytes, its header read for the clip's length, and a clip longer than
`max_audio_seconds` refused before any sample is decoded (a WAV whose data is shorter
than its header says is refused as truncated); then miniaudio decodes it, mixed down to
mono and resampled to the rate the model's feature extractor takes.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import Any

import miniaudio
import numpy as np

from client.protocol import ErrorCode, RequestRejected
from common.media_formats import audio_format

FORMATS = "WAV, FLAC, MP3 and Ogg Vorbis"


@dataclass(frozen=True)
class AudioLimits:
    sample_rate: int  # the model's
    max_seconds: float


_INFO = {"wav": miniaudio.wav_get_info, "flac": miniaudio.flac_get_info, "ogg": miniaudio.vorbis_get_info,
         "mp3": miniaudio.mp3_get_info}


def decode_audio(data: bytes, limits: AudioLimits) -> np.ndarray:
    """The clip as float32 mono samples at `limits.sample_rate`."""
    kind = audio_format(data)
    if kind is None:
        raise RequestRejected(f"not audio in a format served ({FORMATS}): {len(data)} bytes starting {data[:8]!r}")
    info: Any = _INFO[kind](data)
    if info.sample_rate <= 0 or info.nchannels <= 0:
        raise RequestRejected(f"its {kind} header gives no sample rate or channels")
    if kind == "wav":
        _check_not_truncated(data, info.num_frames)
    seconds = info.num_frames / info.sample_rate
    if seconds > limits.max_seconds:
        raise RequestRejected(f"{seconds:g} s of audio by its {kind} header; this worker's max_audio_seconds is "
                              f"{limits.max_seconds:g}", code=ErrorCode.TOO_LARGE)
    decoded = miniaudio.decode(data, output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1,
                               sample_rate=limits.sample_rate)
    if not len(decoded.samples):
        raise RequestRejected(f"a {kind} file with no samples")
    return np.frombuffer(decoded.samples, dtype=np.float32).copy()


def _check_not_truncated(data: bytes, frames: int) -> None:
    """A PCM WAV's header says how many frames follow; miniaudio counts those present."""
    try:
        with wave.open(io.BytesIO(data)) as header:
            declared = header.getnframes()
    except (wave.Error, EOFError):
        return  # a WAV the standard library does not read (float, extensible): miniaudio's word stands
    if frames < declared:
        raise RequestRejected(f"a truncated WAV: its header says {declared} frames, {frames} are there")
