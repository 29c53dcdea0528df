"""The channel between a worker's I/O process and its engine process: a Unix socket
pair, one frame per message (a 4-byte length, then the pickled message).

Pickle, not msgpack: both ends are this package's own processes, started together from
one install, and every message is a frozen dataclass of `worker.messages` (a step's
events, a request to prepare with its media bytes); pickle encodes them once, in C, with
no schema to keep beside the types. Nothing from Redis or a producer is unpickled: a
request's body crosses as the dict `read_envelope` made of it.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import Any

HEADER = struct.Struct("!I")


def frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class BlockingChannel:
    """The engine process's end: blocking reads on one thread, sends from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._sending = threading.Lock()

    def send(self, message: object) -> None:
        data = frame(message)
        with self._sending:
            self._sock.sendall(data)

    def receive(self) -> Any | None:
        """The next message; None once the other end is gone."""
        header = self._reader.read(HEADER.size)
        if len(header) < HEADER.size:
            return None
        (size,) = HEADER.unpack(header)
        data = self._reader.read(size)
        if len(data) < size:
            return None
        return pickle.loads(data)


class AsyncChannel:
    """The I/O process's end, on its event loop: sends never block it (the socket's
    buffer takes them), reads wait for a whole frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def over(cls, sock: socket.socket) -> AsyncChannel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        return cls(reader, writer)

    def send(self, message: object) -> None:
        if not self._writer.is_closing():
            self._writer.write(frame(message))

    async def receive(self) -> Any | None:
        """The next message; None once the other end is gone."""
        try:
            header = await self._reader.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            return pickle.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def close(self) -> None:
        self._writer.close()
