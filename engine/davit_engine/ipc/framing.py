"""Messages on the pipe from the engine core to the API process: a length, then a pickle.

Each frame is an 8-byte big-endian payload length followed by the pickled message. The core
writes whole frames with `write_message` (blocking; its sender thread does it). The API process
reads the pipe from its event loop without ever blocking, through `MessageReader`: a read takes
whatever bytes are there and returns every message they complete, so a message the core is
still writing never stalls the loop, and all messages that queued up are handled together.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
# One read takes at most this much; a full pipe holds far less, so one read usually drains it.
_READ_SIZE = 1 << 20


def write_message(fd: int, message: object) -> None:
    """Write `message` as one frame to the blocking file descriptor `fd`."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


class MessageReader:
    """Reads frames from `fd`, which it switches to non-blocking mode."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._buffer = bytearray()

    def read(self) -> tuple[list[Any], bool]:
        """Every message completed by the bytes readable now, and whether the pipe hit EOF.

        Bytes of a message not yet complete stay buffered for the next call.
        """
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self._buffer += chunk
            if len(chunk) < _READ_SIZE:
                break  # drained: the next call finds what arrives meanwhile
        return self._messages(), eof

    def _messages(self) -> list[Any]:
        messages: list[Any] = []
        buffer, start = self._buffer, 0
        with memoryview(buffer) as view:
            while len(buffer) - start >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, start)
                end = start + _HEADER.size + size
                if end > len(buffer):
                    break
                messages.append(pickle.loads(view[start + _HEADER.size : end]))
                start = end
        del buffer[:start]
        return messages
