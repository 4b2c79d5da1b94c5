"""Client end of the daemon's local channel (see `kvstore.local`): one blocking socket, one frame each way."""

from __future__ import annotations

import socket
import threading
from typing import Any

from kvstore.errors import Unavailable, error_for
from kvstore.handlers import UNARY_METHODS
from kvstore.local import HEADER, METHOD_NAMES

_METHOD_IDS = {name: i for i, name in enumerate(METHOD_NAMES)}


class LocalChannel:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(path)
        self._lock = threading.Lock()

    def call(self, method: str, request: Any) -> Any:
        payload = request.SerializeToString()
        try:
            with self._lock:
                self._sock.sendall(HEADER.pack(len(payload), _METHOD_IDS[method]) + payload)
                length, status = HEADER.unpack(self._recv(HEADER.size))
                body = self._recv(length)
        except OSError as exc:
            self.close()
            raise Unavailable(
                f"{method}: the daemon's local channel {self.path} closed ({exc}); it stopped or restarted"
            ) from None
        if status:
            raise error_for(status, method, body.decode(errors="replace"))
        return UNARY_METHODS[method][1].FromString(body)  # type: ignore[attr-defined]

    def _recv(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            part = self._sock.recv(size - len(data))
            if not part:
                raise ConnectionError("connection closed")
            data += part
        return bytes(data)

    def close(self) -> None:
        self._sock.close()
