"""Who is at the other end of a local TCP connection, and how many connections a TCP port holds.

Both are asked of the kernel's socket diagnostics (``sock_diag`` over netlink, as ``ss`` asks
them), which any user may read: ``peer_uid`` finds the account that owns the client's end of a
loopback connection (the other end of an ``accept``, on this host), so that a server can hold
each local account to a share of its connections whatever address they all come from
(127.0.0.1); ``connections`` counts the connections open on a local port with a filter the
kernel runs, so that a server can bound them without a system call per connection. Either
answers None where the kernel does not (another operating system, a kernel without the module):
the caller then falls back to the address alone, or to no count.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import threading

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_S_GE = 2
INET_DIAG_BC_S_LE = 3
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
TCP_ESTABLISHED = 1
TCP_CLOSE_WAIT = 8
OPEN_STATES = (1 << TCP_ESTABLISHED) | (1 << TCP_CLOSE_WAIT)
"""The states of a connection a server still holds: established, or closed by the peer and not
yet by the server."""
ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")
"""A netlink message's header: length, type, flags, sequence, port id."""
_MESSAGE = struct.Struct("=BBBB4x32x4x8xIIIII")
"""An ``inet_diag_msg`` (family, state, timer, retransmits, the socket's id, expires, queues,
uid, inode)."""
_lock = threading.Lock()
"""One netlink socket per process, used by one thread at a time."""
_netlink: list[socket.socket] = []


def _request(payload: bytes, flags: int) -> list[bytes]:
    """Send one ``SOCK_DIAG_BY_FAMILY`` request and return the messages answered (OSError where
    the kernel refuses)."""
    with _lock:
        if not _netlink:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
            sock.settimeout(1.0)
            _netlink.append(sock)
        sock = _netlink[0]
        header = _HEADER.pack(_HEADER.size + len(payload), SOCK_DIAG_BY_FAMILY, flags, 1, 0)
        sock.send(header + payload)
        answered: list[bytes] = []
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    return answered
                body = data[offset + _HEADER.size : offset + length]
                offset += (length + 3) & ~3
                if kind == NLMSG_DONE:
                    return answered
                if kind == NLMSG_ERROR:
                    error = -struct.unpack_from("=i", body)[0]
                    if error:
                        raise OSError(error, "sock_diag refused the request")
                    return answered
                answered.append(body)
            if not flags & NLM_F_DUMP:
                return answered


def _address(text: str, family: int) -> bytes:
    """An address as ``inet_diag_sockid`` holds it (16 bytes, network order)."""
    return ipaddress.ip_address(text).packed.ljust(16, b"\0")


def _family(host: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def peer_uid(local: tuple[str, int], peer: tuple[str, int]) -> int | None:
    """The uid that owns the other end of the TCP connection from ``peer`` to ``local`` (an
    accepted connection's ``getpeername`` and ``getsockname``), where that end is on this host;
    None where the kernel does not say (the peer is on another host, or sock_diag is missing)."""
    try:
        family = _family(peer[0])
        if family != _family(local[0]):
            return None
        ident = struct.pack("!HH", peer[1], local[1])
        ident += _address(peer[0], family) + _address(local[0], family)
        ident += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
        request = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, ALL_STATES) + ident
        answered = _request(request, NLM_F_REQUEST)
    except (OSError, ValueError):
        return None
    for body in answered:
        if len(body) >= _MESSAGE.size:
            return int(_MESSAGE.unpack_from(body)[7])
    return None


def connections(port: int, host: str = "127.0.0.1") -> int | None:
    """The TCP connections a server on this host holds on local ``port`` (established, or
    closed by the peer and not yet by the server), over ``host``'s family; None where the
    kernel does not say."""
    # the kernel keeps the sockets whose local port is >= port and <= port: two comparisons,
    # each an op and the port; a failed one jumps past the end (rejected)
    code = b"".join(
        struct.pack("=BBH", op, 8, 8 * (2 - index) + 4) + struct.pack("=BBH", 0, 0, port)
        for index, op in enumerate((INET_DIAG_BC_S_GE, INET_DIAG_BC_S_LE))
    )
    attribute = struct.pack("=HH", 4 + len(code), INET_DIAG_REQ_BYTECODE) + code
    try:
        family = _family(host) if host not in ("*", "0.0.0.0", "::") else socket.AF_INET
        request = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, OPEN_STATES)
        request += b"\0" * 48 + attribute
        with contextlib.suppress(TimeoutError):
            return len(_request(request, NLM_F_REQUEST | NLM_F_DUMP))
    except (OSError, ValueError):
        return None
    return None
