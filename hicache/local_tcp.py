"""Who owns a local tcp socket, from the kernel's tables (/proc/net/tcp and tcp6).

Both sides of a loopback connection are sockets of this host, so the kernel names each one's
owner: a client checks the uid behind the port it connects to (``listener_uid``, client
trust), and a daemon without CurveZMQ keys tells the local users behind its connections apart
(``connection_uid``: the socket whose own address is the connection's far end). None when no
such socket is listed (it closed, another host, or /proc is not readable). Stateless; reads
the tables on each call (a few ms with thousands of connections: for a hello, never per
request).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator

_LISTEN = "0A"  # TCP_LISTEN in the st column
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _rows(proc: str) -> Iterator[tuple[IPAddress, int, int, str, int]]:
    """(local address, local port, remote port, state, owner uid) of each socket listed."""
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, name)) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8:
                continue
            hex_address, _, hex_port = fields[1].rpartition(":")
            remote_port = int(fields[2].rpartition(":")[2], 16)
            yield _address(hex_address), int(hex_port, 16), remote_port, fields[3], int(fields[7])


def _address(hex_address: str) -> IPAddress:
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word in host order (little-endian here)
    return ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))


def _unmapped(address: IPAddress) -> IPAddress:
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def listener_uid(port: int, proc: str = "/proc/net") -> int | None:
    """The owner of the socket listening on loopback (or every address) at ``port``."""
    for address, local_port, _, state, uid in _rows(proc):
        address = _unmapped(address)
        if state == _LISTEN and local_port == port:
            if address.is_loopback or address.is_unspecified:
                return uid
    return None


def connection_uid(host: str, port: int, server_port: int, proc: str = "/proc/net") -> int | None:
    """The owner of the local socket at ``host:port`` connected to ``server_port``: the far
    end of a loopback connection a listener on ``server_port`` accepted from there. None for
    another host's address."""
    try:
        peer = _unmapped(ipaddress.ip_address(host))
    except ValueError:
        return None
    if not peer.is_loopback:
        return None  # (another host's socket is not in this host's tables)
    for address, local_port, remote_port, state, uid in _rows(proc):
        if (local_port, remote_port) == (port, server_port) and state != _LISTEN:
            if _unmapped(address) == peer:
                return uid
    return None
