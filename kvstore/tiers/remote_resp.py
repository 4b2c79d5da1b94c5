"""Page records to and from Redis without a copy: sent from, and received into, arena slots.

The remote tier moves pages of a few MiB to tens of MiB. Through the `redis` client a reply
is parsed into a bytes object and then copied into the slot, and a record to store is first
joined into one bytes object, with the GIL held throughout. Here each worker has its own
connection (RESP, one request at a time): a GET `recv_into`s a raw record's payload
directly into the slot, and a SET sends the header and then the slot's bytes as they are,
the GIL released while the kernel copies. The record's header and checksum are checked on
the bytes in place. Compressed records, and replies of an unexpected size, are received
whole and decoded.

- `RecordConnection.open(url, timeout_s)`: a connection per worker thread (unix or TCP; AUTH and
  SELECT as the URL asks); None for `rediss://`, which goes through the `redis` client.
- `exists(name) -> bool`, `pexpire(name, ms)`, `put(name, header, payload, ttl_ms) -> bool`
  (SET NX [PX]: False when a record was already there).
- `RecordConnection.get(name, namespace, key, into, ttl_ms=0) -> Buffer | None`: the page (`into`
  itself, filled) or None where there is no record. Raises `CorruptRecord` for a record that
  does not check out (or a value of another type under its name), `OSError` (or `RespError`)
  for a connection that failed. On any exception the connection is closed: the reply may be
  half read.
"""

from __future__ import annotations

import socket
from typing import Any

from kvstore.codec import Buffer, Codec
from kvstore.tiers.records import HEADER_BYTES, CorruptRecord, unpack_header

FIRST_READ_BYTES = 1 << 16
DEFAULT_PORT = 6379  # as redis-py takes a URL without a port


def address_of(settings: dict[str, Any]) -> str | tuple[str, int]:
    """A unix socket path, or (host, port) with redis-py's defaults for what the URL leaves out."""
    if "path" in settings:
        return str(settings["path"])
    return str(settings.get("host", "localhost")), int(settings.get("port", DEFAULT_PORT))


class RespError(OSError):
    """The server answered with an error, or with something that is not a bulk string."""


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


class RecordConnection:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._rest = bytearray()  # received and not yet taken: only this reply's bytes

    @classmethod
    def open(cls, url: str, timeout_s: float) -> RecordConnection | None:
        from redis.connection import parse_url

        if url.startswith("rediss://"):
            return None
        settings: dict[str, Any] = parse_url(url)
        address = address_of(settings)
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(address, timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = cls(sock)
        try:
            password, username = settings.get("password"), settings.get("username")
            if password is not None:
                auth = (username.encode(), password.encode()) if username else (password.encode(),)
                connection._call(_command(b"AUTH", *auth))
            if settings.get("db"):
                connection._call(_command(b"SELECT", str(settings["db"]).encode()))
        except OSError:
            connection.close()
            raise
        return connection

    def close(self) -> None:
        self._sock.close()

    def exists(self, name: bytes) -> bool:
        return self._call(_command(b"EXISTS", name)) == b":1"

    def pexpire(self, name: bytes, ttl_ms: int) -> None:
        self._call(_command(b"PEXPIRE", name, b"%d" % ttl_ms))

    def put(self, name: bytes, header: bytes, payload: Buffer, ttl_ms: int = 0) -> bool:
        """SET NX of header + payload, the payload sent from where it lies; False: already there."""
        expiry = (b"PX", b"%d" % ttl_ms) if ttl_ms else ()
        parts = (b"SET", name)
        head = b"*%d\r\n" % (len(parts) + 2 + len(expiry))
        head += b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)
        head += b"$%d\r\n" % (len(header) + len(payload)) + header
        tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in (b"NX", *expiry))
        return self._call(head, payload, tail) == b"+OK"

    def _call(self, *chunks: Buffer) -> bytes:
        """One command, sent as `chunks`, with a one-line reply (an error reply raises RespError)."""
        try:
            for chunk in chunks:
                self._sock.sendall(chunk)
            line = self._line()
        except BaseException:
            self.close()
            raise
        if line.startswith(b"-"):
            self.close()
            raise RespError(line[1:].decode(errors="replace"))
        return line

    def get(
        self, name: bytes, namespace: bytes, key: bytes, into: memoryview, ttl_ms: int = 0
    ) -> Buffer | None:
        """With `ttl_ms`, the read also renews the record's expiry (GETEX)."""
        try:
            return self._get(name, namespace, key, into, ttl_ms)
        except BaseException:
            self.close()  # the reply may be half read: this connection is done
            raise

    def _get(self, name: bytes, namespace: bytes, key: bytes, into: memoryview, ttl_ms: int) -> Buffer | None:
        command = _command(b"GETEX", name, b"PX", b"%d" % ttl_ms) if ttl_ms else _command(b"GET", name)
        self._sock.sendall(command)
        line = self._line()
        if line.startswith(b"-WRONGTYPE"):  # something else under a record's name
            raise CorruptRecord(line[1:].decode(errors="replace"))
        if line.startswith(b"-"):
            raise RespError(line[1:].decode(errors="replace"))
        if not line.startswith(b"$"):
            raise RespError(f"expected a bulk string, got {line[:64]!r}")
        length = int(line[1:])
        if length < 0:
            return None
        if length < HEADER_BYTES:
            raise CorruptRecord(f"record is {length} bytes, shorter than a header")
        header = unpack_header(self._exactly(HEADER_BYTES))
        if (header.namespace, header.key) != (namespace, key):
            raise CorruptRecord("the header names another page")
        payload_length = length - HEADER_BYTES
        if header.payload_length != payload_length:
            raise CorruptRecord(f"payload is {payload_length} bytes, the header says {header.payload_length}")
        if header.codec is Codec.NONE and header.raw_length == payload_length == len(into):
            # Stored raw: straight into the slot.
            self._into(into)
            self._crlf()
            header.check_payload(into)
            return into
        payload = bytearray(payload_length)
        self._into(memoryview(payload))
        self._crlf()
        page = header.decode(payload)
        if len(page) != len(into):
            raise CorruptRecord(f"record holds a {len(page)}-byte page, the slot is {len(into)} bytes")
        into[:] = page
        return into

    # -- RESP ---------------------------------------------------------------

    def _receive(self) -> None:
        part = self._sock.recv(FIRST_READ_BYTES)
        if not part:
            raise ConnectionError("the server closed the connection")
        self._rest += part

    def _line(self) -> bytes:
        while (end := self._rest.find(b"\r\n")) < 0:
            if len(self._rest) > 1024:
                raise RespError(f"a reply line longer than 1 KiB: {bytes(self._rest[:64])!r}")
            self._receive()
        line = bytes(self._rest[:end])
        del self._rest[: end + 2]
        return line

    def _exactly(self, size: int) -> bytes:
        while len(self._rest) < size:
            self._receive()
        data = bytes(self._rest[:size])
        del self._rest[:size]
        return data

    def _into(self, view: memoryview) -> None:
        """Fills `view` with the next len(view) bytes of the reply: those received, then the
        rest straight from the socket."""
        taken = min(len(self._rest), len(view))
        view[:taken] = self._rest[:taken]
        del self._rest[:taken]
        filled = taken
        while filled < len(view):
            count = self._sock.recv_into(view[filled:])
            if not count:
                raise ConnectionError("the server closed the connection")
            filled += count

    def _crlf(self) -> None:
        if self._exactly(2) != b"\r\n":
            raise RespError("a bulk string not followed by CRLF")
