"""Native decoders (FFmpeg inside OpenCV, miniaudio) run in processes of their own.

A hostile file may crash or hang a native decoder, and a crash there would take the
whole worker with it. So decodes run in a few long-lived decoder processes, spawned
(never forked: a process that has loaded Apple's frameworks must not fork) with the
decoders imported once and an address-space limit. Each takes one decode at a time,
under a time limit. A crash, a kill or a timeout costs that one decode
(`DecoderDied`), and its process is replaced; the decoder's own refusals come back as
`RequestRejected`. A process that grew large is retired after its decode.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import resource
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from client.protocol import ErrorCode, RequestRejected

T = TypeVar("T")

DECODERS = 2  # processes: decodes of this many requests at once
READY = "ready"  # what a decoder process says once its decoders are imported
START_LIMIT_S = 120.0  # a decoder process not ready in this long (a busy machine: seconds) is given up
_context: Any = multiprocessing.get_context("spawn")

# Fault injection for the tests: a decode whose bytes hold this marker kills its own
# process (`MLXQ_TEST_DECODER_CRASH_ON`) or never returns (`MLXQ_TEST_DECODER_HANG_ON`).
CRASH_ON, HANG_ON = "MLXQ_TEST_DECODER_CRASH_ON", "MLXQ_TEST_DECODER_HANG_ON"


class DecoderDied(RuntimeError):
    """The decoder's process crashed, was killed, or ran past its time."""


class _Decoder:
    """One decoder process and the pipe it is driven through."""

    def __init__(self, memory_bytes: int) -> None:
        """Start the process and wait until it is ready: a decode's time limit counts the
        decode alone, never the process's start (importing its decoders takes seconds on
        a busy machine)."""
        self.connection, theirs = _context.Pipe()
        self.process = _context.Process(target=_serve, args=(theirs, memory_bytes), daemon=True,
                                        name="mlxq-decoder")
        self.process.start()
        theirs.close()
        try:
            ready = self.connection.poll(START_LIMIT_S) and self.connection.recv() == READY
        except EOFError:
            ready = False
        if not ready:
            self.close()
            raise RuntimeError(f"the decoder process did not start ({_how(self.process.exitcode)})")

    def decode(self, decode: Callable[..., Any], data: bytes, args: tuple[Any, ...], where: str,
               timeout_s: float) -> tuple[bool, Any, bool]:
        """(ok, value or (message, code), retire); raises DecoderDied (the process is gone)."""
        try:
            self.connection.send((decode, data, args))
            if not self.connection.poll(timeout_s):
                raise DecoderDied(f"{where}: the decoder ran past media_decode_timeout_s ({timeout_s:g} s) "
                                  "and was killed")
            result: tuple[bool, Any, bool] = self.connection.recv()
            return result
        except (EOFError, BrokenPipeError):
            self.process.join(timeout=5)
            raise DecoderDied(f"{where}: the decoder's process died ({_how(self.process.exitcode)})") from None

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.connection.close()


class _Pool:
    """Up to DECODERS idle decoders; one is started in its place when one dies or retires."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.idle: queue.Queue[_Decoder | Exception] = queue.Queue()
        for _ in range(DECODERS):
            self._replace()

    def _replace(self) -> None:
        """Start a decoder in the background (spawning one takes about a second); one that
        cannot start leaves its error in its place, for the next decode to report."""
        def start() -> None:
            try:
                self.idle.put(_Decoder(self.memory_bytes))
            except Exception as e:  # noqa: BLE001 - a process that cannot start fails a decode, not the worker
                self.idle.put(e)

        threading.Thread(target=start, name="mlxq-decoder-start", daemon=True).start()

    def run(self, decode: Callable[..., Any], data: bytes, args: tuple[Any, ...], where: str,
            timeout_s: float) -> Any:
        decoder = self.idle.get()
        if isinstance(decoder, Exception):
            self._replace()
            raise DecoderDied(f"{where}: no decoder process could be started ({decoder})")
        try:
            ok, value, retire = decoder.decode(decode, data, args, where, timeout_s)
        except DecoderDied:
            decoder.close()
            self._replace()
            raise
        if retire:
            decoder.close()
            self._replace()
        else:
            self.idle.put(decoder)
        if not ok:
            message, code = value
            raise RequestRejected(f"{where}: {message}", code=code)
        return value


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _pool(memory_bytes: int) -> _Pool:
    with _pools_lock:
        if memory_bytes not in _pools:
            _pools[memory_bytes] = _Pool(memory_bytes)
        return _pools[memory_bytes]


def warm_up(memory_bytes: int) -> None:
    """Start the decoder processes now, so that the first video or audio request does
    not wait for them (each imports OpenCV and mlx-vlm: about a second)."""
    _pool(memory_bytes)


def run_isolated(decode: Callable[..., T], data: bytes, *args: Any, where: str, timeout_s: float,
                 memory_bytes: int) -> T:
    """`decode(data, *args)` in a decoder process; raises `DecoderDied` or the decoder's
    `RequestRejected`, each message starting with `where` (the media item: `videos.0`)."""
    return _pool(memory_bytes).run(decode, data, args, where, timeout_s)  # type: ignore[no-any-return]


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def _serve(connection: Connection, memory_bytes: int) -> None:
    """A decoder process: decodes until its pipe closes, or until it has grown past half
    its limit (then it says so with its last answer, and exits)."""
    with contextlib.suppress(ValueError, OSError):  # macOS does not enforce it
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    import worker.media.audio  # noqa: F401 - the decoders, imported once
    import worker.media.videos  # noqa: F401

    connection.send(READY)
    while True:
        try:
            decode, data, args = connection.recv()
        except EOFError:
            return
        _faults(data)
        ok, value = _decoded(decode, data, args, memory_bytes)
        retire = _peak_bytes() > memory_bytes // 2
        connection.send((ok, value, retire))
        if retire:
            return


def _decoded(decode: Callable[..., Any], data: bytes, args: tuple[Any, ...], memory_bytes: int) -> tuple[bool, Any]:
    try:
        return True, decode(data, *args)
    except RequestRejected as e:
        return False, (str(e), e.code)
    except MemoryError:
        return False, (f"decoding needed more than media_decode_memory_mb ({memory_bytes >> 20} MB)",
                       ErrorCode.TOO_LARGE)
    except Exception as e:  # noqa: BLE001 - whatever the decoder says of this file is this request's error
        return False, (f"cannot be decoded ({ascii(str(e)[:300])})", ErrorCode.INVALID_REQUEST)


def _peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _faults(data: bytes) -> None:
    crash, hang = (os.environ.get(name, "").encode() for name in (CRASH_ON, HANG_ON))
    if crash and crash in data:
        os.kill(os.getpid(), signal.SIGSEGV)
    if hang and hang in data:
        signal.pause()
