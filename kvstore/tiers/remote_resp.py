"""RESP connections to one Redis or Valkey server: page records sent from, and received into,
arena slots without a copy, and the few other commands the remote tier sends.

The remote tier moves pages of a few MiB to tens of MiB. Through the `redis` client a reply
is parsed into a bytes object and then copied into the slot, and a record to store is first
joined into one bytes object, with the GIL held throughout. Here each worker has its own
connection (RESP, one request at a time): a GET `recv_into`s a raw record's payload
directly into the slot, and a SET sends the header and then the slot's bytes as they are,
the GIL released while the kernel copies. The record's header and checksum are checked on
the bytes in place. Compressed records, and replies of an unexpected size, are received
whole and decoded.

- `Endpoint.parse(url)` (`remote_resp_endpoint`): where and how to reach a server (unix or
  TCP; AUTH with a user and a password, SELECT, and TLS for `rediss://`: `ssl_ca_certs`,
  `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs=none`, `ssl_check_hostname=false` in the
  query, as redis-py takes them); `endpoint.at(host, port)`: the same credentials and TLS at
  another node of a cluster.
- `RecordConnection.open(endpoint, timeout_s)`, then
  - `exists(name) -> bool`, `pexpire(name, ms)`, `put(name, header, payload, ttl_ms) -> bool`
    (SET NX [PX]: False when a record was already there);
  - `get(name, namespace, key, into, ttl_ms=0, record_key=None) -> Buffer | None`: the page
    (`into` itself, filled) or None where there is no record. With a `RecordKey`, the record must
    carry a MAC that checks out under it, computed on each part of the payload as it lands in
    `into` (`ForgedRecord` otherwise); without one, a MAC is skipped. Raises `CorruptRecord` for a
    record that does not check out (or a value of another type under its name, or a page of
    another size than `into`, refused before its payload is read), `OSError` (or `RespError`) for
    a connection that failed. On any exception but a `Redirect` the connection is closed: the
    reply may be half read;
  - `call(*parts)`: any command, its reply parsed (bulk strings as bytes, arrays as lists);
    `send(commands)` then `replies(n)` (or `line_replies(n)`, where each is one line): pipelined
    commands, the caller reading each server's replies after sending to all of them. An error
    reply is returned among these (a `RespError`), raised by the other calls.
- `Redirect`: a cluster's `-MOVED` or `-ASK` (the slot, the node that serves it, and whether it
  is only for this one request); the connection stays usable. Where to follow one, if anywhere,
  is the tier's decision (`remote_nodes.Nodes.follow`): this module only parses it. It, `RespError`
  and `command` are RESP's pieces that need no connection (`remote_resp_protocol`).
"""

from __future__ import annotations

import contextlib
import hmac
import socket
from collections.abc import Sequence
from typing import Any

from kvstore.tiers.codec import Buffer, Codec
from kvstore.tiers.records import (
    HEADER_BYTES,
    MAC_BYTES,
    CorruptRecord,
    ForgedRecord,
    RecordHeader,
    RecordKey,
    unpack_header,
)
from kvstore.tiers.remote_resp_endpoint import (
    DEFAULT_PORT,
    Address,
    Endpoint,
    address_of,
    format_address,
    tls_context,
)
from kvstore.tiers.remote_resp_protocol import Redirect, RespError, command, error_of, line_reply

__all__ = [
    "Address",
    "DEFAULT_PORT",
    "Endpoint",
    "RecordConnection",
    "Redirect",
    "RespError",
    "address_of",
    "command",
    "error_of",
    "format_address",
    "tls_context",
]

FIRST_READ_BYTES = 1 << 16
# Replies other than records (INFO, CLUSTER SLOTS) past these are not ones the tier asked for.
MAX_REPLY_ITEMS = 1 << 20
MAX_REPLY_BYTES = 16 << 20


class RecordConnection:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._rest = bytearray()  # received and not yet taken: only this reply's bytes

    @classmethod
    def open(cls, endpoint: Endpoint, timeout_s: float) -> RecordConnection:
        address = endpoint.address
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
        if endpoint.tls is not None:
            host = address if isinstance(address, str) else address[0]
            try:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=host)
            except OSError:
                sock.close()
                raise
        connection = cls(sock)
        try:
            if endpoint.password is not None:
                user = (endpoint.username.encode(),) if endpoint.username else ()
                connection.call(b"AUTH", *user, endpoint.password.encode())
            if endpoint.db:
                connection.call(b"SELECT", b"%d" % endpoint.db)
        except OSError:
            connection.close()
            raise
        return connection

    def close(self) -> None:
        self._sock.close()

    def settimeout(self, timeout_s: float) -> None:
        self._sock.settimeout(timeout_s)

    def exists(self, name: bytes) -> bool:
        return self.call(b"EXISTS", name) == 1

    def pexpire(self, name: bytes, ttl_ms: int) -> None:
        self.call(b"PEXPIRE", name, b"%d" % ttl_ms)

    def asking(self) -> None:
        """The next command is for a slot this node is importing (after an ASK redirect)."""
        self.call(b"ASKING")

    def put(self, name: bytes, header: bytes, payload: Buffer, ttl_ms: int = 0) -> bool:
        """SET NX of header + payload, the payload sent from where it lies; False: already there."""
        expiry = (b"PX", b"%d" % ttl_ms) if ttl_ms else ()
        parts = (b"SET", name)
        head = b"*%d\r\n" % (len(parts) + 2 + len(expiry))
        head += b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)
        head += b"$%d\r\n" % (len(header) + len(payload)) + header
        tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in (b"NX", *expiry))
        return self._exchange(head, payload, tail) == b"OK"

    def call(self, *parts: bytes) -> Any:
        """One command and its reply (an error reply raises RespError)."""
        return self._exchange(command(*parts))

    def send(self, commands: Sequence[bytes]) -> None:
        """Sends encoded `commands` (`command(...)`) at once; `replies` reads their answers."""
        try:
            self._sock.sendall(b"".join(commands))
        except BaseException:
            self.close()
            raise

    def replies(self, count: int) -> list[Any]:
        """The next `count` replies; an error reply is a RespError in the list, not raised."""
        try:
            return [self._reply() for _ in range(count)]
        except BaseException:
            self.close()
            raise

    def line_replies(self, count: int) -> list[Any]:
        """`replies` where each is one line (an integer, a status or an error, as EXISTS and
        ASKING answer): parsed together, for a Lookup's hundreds of them."""
        try:
            while self._rest.count(b"\r\n") < count:
                if len(self._rest) > count * 1024:
                    raise RespError(f"replies longer than a line: {bytes(self._rest[:64])!r}")
                self._receive()
            *lines, rest = bytes(self._rest).split(b"\r\n", count)
            self._rest = bytearray(rest)
            if all(line[:1] == b":" for line in (lines[0], lines[-1])):
                # Integers alone (EXISTS), the common case: parsed in one pass, checked whole.
                replies = b"\r\n".join(lines)[1:].split(b"\r\n:")
                if len(replies) == count:  # else a line of another kind is among them
                    with contextlib.suppress(ValueError):
                        return list(map(int, replies))
            return [line_reply(line) for line in lines]
        except BaseException:
            self.close()
            raise

    def _exchange(self, *chunks: Buffer) -> Any:
        try:
            for chunk in chunks:
                self._sock.sendall(chunk)
            reply = self._reply()
        except BaseException:
            self.close()
            raise
        if isinstance(reply, RespError):
            raise reply  # read whole: the connection stays usable
        return reply

    def get(
        self,
        name: bytes,
        namespace: bytes,
        key: bytes,
        into: memoryview,
        ttl_ms: int = 0,
        record_key: RecordKey | None = None,
    ) -> Buffer | None:
        """With `ttl_ms`, the read also renews the record's expiry (GETEX)."""
        try:
            return self._get(name, namespace, key, into, ttl_ms, record_key)
        except Redirect:
            raise  # the reply was one line, read whole
        except BaseException:
            self.close()  # the reply may be half read: this connection is done
            raise

    def _get(
        self,
        name: bytes,
        namespace: bytes,
        key: bytes,
        into: memoryview,
        ttl_ms: int,
        record_key: RecordKey | None,
    ) -> Buffer | None:
        request = command(b"GETEX", name, b"PX", b"%d" % ttl_ms) if ttl_ms else command(b"GET", name)
        self._sock.sendall(request)
        length = self._record_length()
        if length is None:
            return None
        head = self._exactly(HEADER_BYTES)
        header = unpack_header(head)
        if (header.namespace, header.key) != (namespace, key):
            raise CorruptRecord("the header names another page")
        payload_length, mac = self._mac(header, length, record_key)
        if header.payload_length != payload_length:
            raise CorruptRecord(f"payload is {payload_length} bytes, the header says {header.payload_length}")
        if header.raw_length != len(into) or payload_length > len(into):
            # Refused before a byte of the payload is read (a record of 1 MiB claiming 256 MiB).
            raise CorruptRecord(
                f"record holds a {header.raw_length}-byte page, the slot is {len(into)} bytes"
            )
        hasher = None if record_key is None else record_key.hasher(head)
        if header.codec is Codec.NONE and payload_length == len(into):
            # Stored raw: straight into the slot, the MAC taken on each part as it lands (in cache).
            self._into(into, hasher)
            self._crlf()
            if hasher is None:
                header.check_payload(into)
            else:  # the MAC covers the header's checksum and the payload: it is the stronger check
                RecordKey.verify(hasher, mac)
            return into
        payload = bytearray(payload_length)
        self._into(memoryview(payload), hasher)
        self._crlf()
        if hasher is not None:
            RecordKey.verify(hasher, mac)
        page = header.decode(payload)
        if len(page) != len(into):
            raise CorruptRecord(f"record holds a {len(page)}-byte page, the slot is {len(into)} bytes")
        into[:] = page
        return into

    def _record_length(self) -> int | None:
        """The length of the record a GET answers (None: there is none), at least a header's."""
        line = self._line()
        if line.startswith(b"-WRONGTYPE"):  # something else under a record's name
            raise CorruptRecord(line[1:].decode(errors="replace"))
        if line.startswith(b"-"):
            raise error_of(line[1:])
        if not line.startswith(b"$"):
            raise RespError(f"expected a bulk string, got {line[:64]!r}")
        length = int(line[1:])
        if length < 0:
            return None
        if length < HEADER_BYTES:
            raise CorruptRecord(f"record is {length} bytes, shorter than a header")
        return length

    def _mac(self, header: RecordHeader, length: int, record_key: RecordKey | None) -> tuple[int, bytes]:
        """(the payload's length, the record's MAC, read: empty without one) of a `length`-byte
        record; `ForgedRecord` for one without a MAC where this daemon has a record key."""
        payload_length = length - HEADER_BYTES
        mac = b""
        if header.authenticated:
            if payload_length < MAC_BYTES:
                raise CorruptRecord(f"record is {length} bytes, shorter than a header and its MAC")
            mac = self._exactly(MAC_BYTES)
            payload_length -= MAC_BYTES
        elif record_key is not None:
            raise ForgedRecord("it carries no MAC, and this daemon has a record key")
        return payload_length, mac

    # -- RESP ---------------------------------------------------------------

    def _reply(self) -> Any:
        """One reply: bytes (simple or bulk string), int, None, a list, or a RespError (returned)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return error_of(rest)
        if kind == b":":
            return int(rest)
        if kind in (b"$", b"*"):
            count = int(rest)
            if count < 0:
                return None
            if kind == b"$":
                if count > MAX_REPLY_BYTES:
                    raise RespError(f"a reply of {count} bytes")
                data = self._exactly(count)
                self._crlf()
                return data
            if count > MAX_REPLY_ITEMS:
                raise RespError(f"an array reply of {count} items")
            return [self._reply() for _ in range(count)]
        raise RespError(f"an unexpected reply {line[:64]!r}")

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

    def _into(self, view: memoryview, hasher: hmac.HMAC | None = None) -> None:
        """Fills `view` with the next len(view) bytes of the reply: those received, then the
        rest straight from the socket; `hasher` takes each part as it arrives."""
        taken = min(len(self._rest), len(view))
        view[:taken] = self._rest[:taken]
        del self._rest[:taken]
        if hasher is not None:
            hasher.update(view[:taken])
        filled = taken
        while filled < len(view):
            count = self._sock.recv_into(view[filled:])
            if not count:
                raise ConnectionError("the server closed the connection")
            if hasher is not None:
                hasher.update(view[filled : filled + count])
            filled += count

    def _crlf(self) -> None:
        if self._exactly(2) != b"\r\n":
            raise RespError("a bulk string not followed by CRLF")
