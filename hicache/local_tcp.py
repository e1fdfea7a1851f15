"""Who owns a local tcp socket, from the kernel's tables.

Both sides of a loopback connection are sockets of this host, so the kernel names each one's
owner: a client checks the uid behind the port it connects to (``listener_uid``, client
trust: /proc/net/tcp, once per connection), and a daemon without CurveZMQ keys tells the
local users behind its connections apart (``connection_uid``: the socket at the connection's
far end, looked up by its address pair through netlink, at a hello). None when no such
socket is there (it closed, another host, or the kernel's tables cannot be read). Stateless.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator

_LISTEN = "0A"  # TCP_LISTEN in the st column
# netlink socket diagnostics (linux/sock_diag.h, linux/inet_diag.h)
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_ALL_STATES = 0xFFFFFFFF
_NO_COOKIE = (0xFFFFFFFF, 0xFFFFFFFF)  # INET_DIAG_NOCOOKIE: any socket of that address pair
# the uid in a reply: after nlmsghdr (16), family/state/timer/retrans (4), the socket id (48),
# expires, rqueue and wqueue (12)
_UID_AT = 16 + 4 + 48 + 12  # (its inode follows)
_STATE_AT = 16 + 1
_TIME_WAIT = 6
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


def connection_uid(host: str, port: int, server_host: str, server_port: int) -> int | None:
    """The owner of the local socket at ``host:port`` connected to ``server_host:
    server_port``: the far end of a connection a listener there accepted, when that end is
    a socket of this host (from any of its addresses, not only loopback ones). One exact
    look-up through the kernel's socket diagnostics (netlink ``sock_diag``, about 15 us;
    /proc/net/tcp would take 12 ms with 4,000 sockets). None for another host's socket, one
    gone, one its process closed already (the kernel then names no owner: a closing or
    TIME_WAIT socket reads as root's), or a kernel without the diagnostics."""
    try:
        peer = _unmapped(ipaddress.ip_address(host))
        server = _unmapped(ipaddress.ip_address(server_host))
    except ValueError:
        return None
    if peer.version != server.version:
        return None
    family = socket.AF_INET if peer.version == 4 else socket.AF_INET6
    request = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, _ALL_STATES)
    request += struct.pack("!HH", port, server_port)
    request += peer.packed.ljust(16, b"\0") + server.packed.ljust(16, b"\0")
    request += struct.pack("=III", 0, *_NO_COOKIE)
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(header + request, (0, 0))
            reply = nl.recv(4096)
    except OSError:  # no netlink here (another OS, a sandbox): not known
        return None
    if len(reply) < _UID_AT + 8 or struct.unpack_from("=H", reply, 4)[0] == _NLMSG_ERROR:
        return None  # (ENOENT: no such socket here)
    state = reply[_STATE_AT]
    uid, inode = struct.unpack_from("=II", reply, _UID_AT)
    if state == _TIME_WAIT or inode == 0:
        return None  # no process holds it any more
    return uid
