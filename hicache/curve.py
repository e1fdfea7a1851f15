"""CurveZMQ keys for tcp endpoints: who may talk to a daemon over the network. Below both
sides: the client's sockets and ``hicache keygen`` use it, and the daemon loads its server key
and ZAP settings with it. Sets options on sockets it is given; opens none.

An ipc socket is private by its file mode (0600 in a 0700 folder). A tcp port is open to the
whole network, so a daemon listens on a tcp address other than loopback only with CurveZMQ:
traffic is encrypted, and only clients whose public key is in the daemon's client folder get
in (a ZAP handler checks each connection). Keys are ZeroMQ certificate files:
``hicache keygen --dir D --name N`` writes ``D/N.key`` (the public key, to hand out) and
``D/N.key_secret`` (0600, to keep).

- daemon: ``--curve-secret-key D/server.key_secret --curve-clients FOLDER`` (FOLDER holds the
  allowed clients' ``.key`` files);
- client (HiCacheClient, the CLI, the vLLM connector): ``HICACHE_CURVE_SERVER_KEY`` (the
  daemon's public ``.key`` file) and ``HICACHE_CURVE_CLIENT_KEY`` (its own ``.key_secret``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVER_KEY_ENV = "HICACHE_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "HICACHE_CURVE_CLIENT_KEY"


class CurveKeyError(ValueError):
    """A key file that cannot be used; the message names it and says why."""


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes  # the daemon's public key (Z85)
    public: bytes  # this client's key pair
    secret: bytes


def keygen(folder: str, name: str) -> tuple[str, str]:
    """Write a key pair ``folder/name.key`` (public) and ``.key_secret`` (mode 0600)."""
    import zmq.auth

    if not name or os.sep in name or name.startswith("."):
        raise CurveKeyError(f"keygen: {name!r} is not a plain file name")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        public, secret = zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def load_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file that only its owner can read."""
    import zmq.auth

    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise CurveKeyError(f"{path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveKeyError(f"{path}: a secret key readable by others is refused (chmod 600 it)")
    public, secret = _load(zmq.auth, path)
    if secret is None:
        raise CurveKeyError(f"{path}: holds no secret key (use the .key_secret file)")
    return public, secret


def load_public(path: str) -> bytes:
    import zmq.auth

    return _load(zmq.auth, path)[0]


def _load(auth: Any, path: str) -> tuple[bytes, bytes | None]:
    try:
        return auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path}: not a ZeroMQ certificate file ({exc})") from None


def client_keys(environ: Mapping[str, str] | None = None) -> ClientKeys | None:
    """The keys a client uses, from HICACHE_CURVE_SERVER_KEY and HICACHE_CURVE_CLIENT_KEY
    (None when neither is set; CurveKeyError when only one is, or a file is unusable)."""
    environ = os.environ if environ is None else environ
    server, client = environ.get(SERVER_KEY_ENV), environ.get(CLIENT_KEY_ENV)
    if not server and not client:
        return None
    if not server or not client:
        raise CurveKeyError(f"CurveZMQ needs both {SERVER_KEY_ENV} and {CLIENT_KEY_ENV}")
    public, secret = load_secret(client)
    return ClientKeys(load_public(server), public, secret)


def apply_client(sock: Any, keys: ClientKeys) -> None:
    """Make ``sock`` (before connect) a CurveZMQ client of the daemon."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
