"""A request's audio bytes turned into one channel of samples at the model's rate, in the
decoder's own process (`isolated`).

miniaudio reads WAV, FLAC, MP3 and Ogg Vorbis from memory. The format is told from the
file's first bytes, its header read for the clip's length, and a clip longer than
`max_audio_seconds` refused before any sample is decoded; then miniaudio decodes it,
mixed down to mono and resampled to the rate the model's feature extractor takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import miniaudio
import numpy as np

from client.protocol import ErrorCode, RequestRejected

FORMATS = "WAV, FLAC, MP3 and Ogg Vorbis"


@dataclass(frozen=True)
class AudioLimits:
    sample_rate: int  # the model's
    max_seconds: float


def sniff(data: bytes) -> str | None:
    """The container `data` starts like, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


_INFO = {"wav": miniaudio.wav_get_info, "flac": miniaudio.flac_get_info, "ogg": miniaudio.vorbis_get_info,
         "mp3": miniaudio.mp3_get_info}


def decode_audio(data: bytes, limits: AudioLimits) -> np.ndarray:
    """The clip as float32 mono samples at `limits.sample_rate`."""
    kind = sniff(data)
    if kind is None:
        raise RequestRejected(f"not audio in a format served ({FORMATS}): {len(data)} bytes starting {data[:8]!r}")
    info: Any = _INFO[kind](data)
    if info.sample_rate <= 0 or info.nchannels <= 0:
        raise RequestRejected(f"its {kind} header gives no sample rate or channels")
    seconds = info.num_frames / info.sample_rate
    if seconds > limits.max_seconds:
        raise RequestRejected(f"{seconds:g} s of audio by its {kind} header; this worker's max_audio_seconds is "
                              f"{limits.max_seconds:g}", code=ErrorCode.TOO_LARGE)
    decoded = miniaudio.decode(data, output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1,
                               sample_rate=limits.sample_rate)
    if not len(decoded.samples):
        raise RequestRejected(f"a {kind} file with no samples")
    return np.frombuffer(decoded.samples, dtype=np.float32).copy()
