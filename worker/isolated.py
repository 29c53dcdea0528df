"""Native decoders (FFmpeg inside OpenCV, miniaudio) run in a child process of their own.

A hostile file may crash or hang a native decoder, and a crash there would take the
whole worker with it. So each decode runs in a fresh child, forked from a small server
process (multiprocessing's forkserver, which preloads the decoders once), under an
address-space limit and a time limit. A crash, a kill or a timeout costs that one
decode (`DecoderDied`); the child's own refusals come back as `RequestRejected`. On
macOS children are spawned instead: a process that has loaded Apple's frameworks must
not fork.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from client.protocol import ErrorCode, RequestRejected

T = TypeVar("T")

_context: Any = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
if sys.platform == "linux":  # what the server imports once, so that each child starts with the decoders loaded
    _context.set_forkserver_preload(["worker.videos", "worker.audio"])

# Fault injection for the tests: a decode whose bytes hold this marker kills its own
# process (`MLXQ_TEST_DECODER_CRASH_ON`) or never returns (`MLXQ_TEST_DECODER_HANG_ON`).
CRASH_ON, HANG_ON = "MLXQ_TEST_DECODER_CRASH_ON", "MLXQ_TEST_DECODER_HANG_ON"


def warm_up() -> None:
    """Start the decoders' server now, in the background, so that the first video or
    audio request does not wait for it (it imports OpenCV and mlx-vlm: about a second)."""
    if sys.platform == "linux":
        from multiprocessing import forkserver

        threading.Thread(target=forkserver.ensure_running, name="mlxq-decoders", daemon=True).start()


class DecoderDied(RuntimeError):
    """The decoder's process crashed, was killed, or ran past its time."""


def run_isolated(decode: Callable[..., T], data: bytes, *args: Any, where: str, timeout_s: float,
                 memory_bytes: int) -> T:
    """`decode(data, *args)` in a child process; raises `DecoderDied` or the child's
    `RequestRejected`, each message starting with `where` (the media item: `videos.0`)."""
    receiver, sender = _context.Pipe(duplex=False)
    child = _context.Process(target=_child, args=(sender, decode, data, args, memory_bytes), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise DecoderDied(f"{where}: the decoder ran past media_decode_timeout_s ({timeout_s:g} s) and was "
                              "killed")
        try:
            ok, value = receiver.recv()
        except EOFError:
            child.join(timeout=5)
            raise DecoderDied(f"{where}: the decoder's process died ({_how(child.exitcode)})") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=5)
        receiver.close()
    if not ok:
        message, code = value
        raise RequestRejected(f"{where}: {message}", code=code)
    return value  # type: ignore[no-any-return]


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def _child(sender: Connection, decode: Callable[..., Any], data: bytes, args: tuple[Any, ...],
           memory_bytes: int) -> None:
    with contextlib.suppress(ValueError, OSError):  # macOS does not enforce it
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    _faults(data)
    try:
        result: tuple[bool, Any] = (True, decode(data, *args))
    except RequestRejected as e:
        result = (False, (str(e), e.code))
    except MemoryError:
        result = (False, (f"decoding needed more than media_decode_memory_mb ({memory_bytes >> 20} MB)",
                          ErrorCode.TOO_LARGE))
    except Exception as e:  # noqa: BLE001 - whatever the decoder says of this file is this request's error
        result = (False, (f"cannot be decoded ({ascii(str(e)[:300])})", ErrorCode.INVALID_REQUEST))
    sender.send(result)
    sender.close()


def _faults(data: bytes) -> None:
    crash, hang = (os.environ.get(name, "").encode() for name in (CRASH_ON, HANG_ON))
    if crash and crash in data:
        os.kill(os.getpid(), signal.SIGSEGV)
    if hang and hang in data:
        signal.pause()
