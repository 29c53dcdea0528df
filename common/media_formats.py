"""Which container a media file is, told from its first bytes: checked at the edge (the
gateway, against the format a request says) and in the worker, before any decoder runs."""

from __future__ import annotations

# The audio formats miniaudio decodes, by the name OpenAI's `input_audio.format` uses.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def audio_format(data: bytes) -> str | None:
    """The audio container `data` starts like (one of AUDIO_FORMATS), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None
