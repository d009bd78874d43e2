"""Authenticated JSON links between the driver and its ranks or node agents.

- ``ControlListener``: a TCP listener (127.0.0.1 and a random authkey for a group on this host; a
  configured address and the cluster key for a multi-node driver) whose ``accept`` takes a timeout
  (``multiprocessing.connection.Listener.accept`` cannot); ``authenticate`` is its side of the
  mutual HMAC handshake that ``multiprocessing.connection.Client`` and :func:`connect` speak.
- ``set_keepalive`` / ``hang_up``: noticing a host that vanished, and waking a blocked reader.

What travels on a link is :mod:`ppoflow.infra.remote.protocol`'s messages; nothing is pickled.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import struct
from collections.abc import Iterator
from multiprocessing import AuthenticationError  # the class connection raises (typeshed has it here)
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

__all__ = ["ControlListener", "authenticate", "connect", "read_timeout", "set_keepalive", "hang_up"]


@contextlib.contextmanager
def read_timeout(conn: Connection, seconds: float) -> Iterator[None]:
    """Inside the block, a read on ``conn`` that waits more than ``seconds`` (whole, >= 1) fails
    with ``OSError`` instead of blocking: for handshakes with a peer that may never speak."""
    timeval = struct.Struct("ll")  # struct timeval on Linux
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket, to set its option
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval.pack(max(1, int(seconds)), 0))
        yield
    finally:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval.pack(0, 0))
        except OSError:
            pass
        sock.close()


def authenticate(conn: Connection, authkey: bytes, timeout: float = 10.0) -> bool:
    """The server side of ``multiprocessing.connection``'s mutual HMAC handshake (what
    ``Client(address, authkey=...)`` answers), with a time limit so a silent peer cannot hold
    the caller. True if the peer proved it holds ``authkey``; the link is closed otherwise."""
    try:
        with read_timeout(conn, timeout):
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        return True
    except (AuthenticationError, EOFError, OSError):
        conn.close()
        return False


def connect(address: tuple[str, int], authkey: bytes, timeout: float = 10.0) -> Connection:
    """The client side of ``authenticate``: a TCP connection to ``address`` (giving up after
    ``timeout`` seconds, where ``multiprocessing.connection.Client`` would wait for the OS) and
    the mutual HMAC handshake. Raises ``OSError`` (unreachable, refused, silent) or
    ``AuthenticationError`` (the two sides hold different keys)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        with read_timeout(conn, timeout):
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


class ControlListener:
    """Accepts authenticated ``multiprocessing.connection`` links from the ranks, with timeouts.

    ``host`` is the interface to listen on (127.0.0.1 for a group on this host), ``port`` 0 for
    any free one; ``authkey`` defaults to 32 random bytes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, authkey: bytes | None = None):
        self.authkey = authkey or secrets.token_bytes(32)
        self._sock = socket.create_server((host, port), backlog=128)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept_raw(self, timeout: float) -> tuple[Connection, tuple] | None:
        """The next connection before any handshake, with the peer's address (None on timeout)."""
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not readable:
            return None
        try:
            sock, peer = self._sock.accept()
        except OSError:
            return None
        sock.setblocking(True)
        return Connection(sock.detach()), peer

    def accept(self, timeout: float) -> Connection | None:
        """One authenticated connection, or None if none arrived within ``timeout`` seconds (or the
        peer failed the handshake)."""
        got = self.accept_raw(timeout)
        if got is None:
            return None
        return got[0] if authenticate(got[0], self.authkey) else None

    def close(self) -> None:
        self._sock.close()


def set_keepalive(conn: Connection, idle_s: int = 10, interval_s: int = 5, count: int = 3) -> None:
    """TCP keepalive on a link, so a host that vanishes (power, network) without closing its
    sockets is noticed in about ``idle_s + interval_s * count`` seconds, not hours."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    finally:
        sock.close()


def hang_up(conn: Connection) -> None:
    """Shut a link's socket down both ways: a thread blocked reading it wakes up with EOF (a plain
    close does not wake it), and the peer sees the link end."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
