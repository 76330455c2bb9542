"""Credentials and identities: who a peer is and what its role lets it do.

Theory of operation
-------------------
Servers (metanodes, datanodes, cache nodes) hold the cluster secret. Every
other credential is a key id and a key derived from that secret::

    key = HMAC-SHA256(cluster_secret, "cachefs-credential|" + key_id)

The key id names the role, a name, and for clients the volumes::

    server:<name>                   a daemon (it derives its own key)
    admin:<name>                    cluster administration
    client:<name>:<vol>[,<vol>...]  client operations on those volumes only

So a server verifies any credential from its key id alone (no key database),
and a holder cannot derive another key id's key, nor widen its own (the key
id is the input of the MAC). ``cachefs credential issue`` makes them. The
trust boundary is the cluster secret: a server holds it and can therefore act
as anyone; what roles protect against is a client or admin credential (a
training job's, a notebook's) doing more than it was issued for.

With TLS the same credentials are used: the certificate authenticates the
channel, the credential the identity, one code path for both.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from cachefs.errors import AuthFailed, InvalidArgument, PermissionDenied

SERVER, ADMIN, CLIENT = "server", "admin", "client"
ROLES = (SERVER, ADMIN, CLIENT)
# Who may call what: an ``@rpc_method`` names one of these (or its own set).
SERVERS = frozenset({SERVER})
ADMINS = frozenset({SERVER, ADMIN})
CLIENTS = frozenset({SERVER, ADMIN, CLIENT})
ANYONE = CLIENTS

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_KEY_ID = 1024
MAX_TAG = 96  # Identity.tag: at most 64 + 16 + 2 + len("client:") otherwise


@dataclass(frozen=True, slots=True)
class Identity:
    """The authenticated peer of a connection, as handlers see it in ``ctx.identity``.

    ``volumes`` is None for roles that are not confined to volumes (server,
    admin, and everyone on an insecure server).
    """

    role: str
    name: str
    volumes: frozenset[str] | None = None
    insecure: bool = False
    # A short name unique to the key id: the metanodes put it before the
    # ``client_id`` of this identity's commands (so before its sessions and
    # dedup entries too). The key id itself when short; a client naming many
    # volumes gets its role, name and a digest (``~`` is in no key id, so the
    # two forms never meet); "" for an insecure peer.
    tag: str = field(default="", init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        kid = f"{self.role}:{self.name}"
        if self.volumes is not None:
            kid += ":" + ",".join(sorted(self.volumes))
        if len(kid) > MAX_TAG:
            kid = f"{self.role}:{self.name}:~{hashlib.sha256(kid.encode()).hexdigest()[:16]}"
        object.__setattr__(self, "tag", "" if self.insecure else kid)

    def __str__(self) -> str:
        return "insecure peer" if self.insecure else f"{self.role} {self.name!r}"

    def may(self, roles: frozenset[str]) -> bool:
        return self.insecure or self.role in roles

    def may_use(self, volume: str) -> bool:
        return self.volumes is None or volume in self.volumes

    def check_volume(self, volume: str) -> None:
        """Raises PermissionDenied (EACCES) unless this identity holds ``volume``."""
        if not self.may_use(volume):
            raise PermissionDenied(f"{self} has no credential for volume {volume!r}", volume=volume)

    @property
    def metanode_id(self) -> int | None:
        """The Raft id of a metanode identity (``server:metanode-<id>``), else None."""
        if self.role != SERVER or not self.name.startswith("metanode-"):
            return None
        number = self.name.removeprefix("metanode-")
        return int(number) if number.isdigit() else None


INSECURE = Identity(role="", name="", insecure=True)


def metanode_name(node_id: int) -> str:
    """The server name a metanode authenticates with, so Raft can check ``src``."""
    return f"metanode-{node_id}"


def key_id(role: str, name: str, volumes: list[str] | tuple[str, ...] | frozenset[str] = ()) -> str:
    """The key id of a credential.

    Raises:
        InvalidArgument: unknown role, a bad name or volume, volumes on a
            role that has none, or a client credential without volumes.
    """
    if role not in ROLES:
        raise InvalidArgument(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not _NAME.match(name):
        raise InvalidArgument(f"credential name {name!r}: use 1-64 of [A-Za-z0-9_.-]")
    if role != CLIENT:
        if volumes:
            raise InvalidArgument(f"a {role} credential is not confined to volumes")
        return f"{role}:{name}"
    if not volumes:
        raise InvalidArgument("a client credential needs at least one volume")
    for volume in volumes:
        if not _NAME.match(volume):
            raise InvalidArgument(f"volume name {volume!r}: use 1-64 of [A-Za-z0-9_.-]")
    return f"{role}:{name}:{','.join(sorted(set(volumes)))}"


def parse_key_id(text: str) -> Identity:
    """The identity a key id names.

    Raises:
        AuthFailed: not a well-formed key id (a peer sent it: it does not get in).
    """
    role, _, rest = text.partition(":")
    name, _, volumes = rest.partition(":")
    try:
        if role == CLIENT:
            vols = [v for v in volumes.split(",") if v]
            if key_id(role, name, vols) != text:
                raise InvalidArgument("not in canonical form")
            return Identity(role, name, frozenset(vols))
        if key_id(role, name) != text:
            raise InvalidArgument("not in canonical form")
    except InvalidArgument as exc:
        raise AuthFailed(f"malformed key id {text[:80]!r}: {exc.message}") from None
    return Identity(role, name)


def derive_key(cluster_secret: bytes, kid: str) -> bytes:
    return hmac.new(cluster_secret, b"cachefs-credential|" + kid.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Credential:
    """What a peer authenticates with: a key id and its key."""

    key_id: str
    key: bytes

    def __repr__(self) -> str:  # never the key
        return f"Credential({self.key_id!r})"

    @property
    def identity(self) -> Identity:
        return parse_key_id(self.key_id)

    @classmethod
    def issue(cls, cluster_secret: bytes, role: str, name: str,
              volumes: list[str] | tuple[str, ...] = ()) -> Credential:
        kid = key_id(role, name, volumes)
        return cls(kid, derive_key(cluster_secret, kid))

    @classmethod
    def server(cls, cluster_secret: bytes, name: str = "cluster") -> Credential:
        """A daemon's own credential, derived from the cluster secret it holds."""
        return cls.issue(cluster_secret, SERVER, name)

    def to_json(self) -> str:
        return json.dumps({"key_id": self.key_id, "key": self.key.hex()}) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "credential") -> Credential:
        """Raises InvalidArgument naming ``where`` and what is wrong."""
        try:
            data = json.loads(text)
            kid, key = data["key_id"], bytes.fromhex(data["key"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{where}: not a cachefs credential ({exc.__class__.__name__}: {exc})") from None
        if not isinstance(kid, str) or len(key) != 32:
            raise InvalidArgument(f"{where}: not a cachefs credential (key_id must be a string, key 32 bytes)")
        try:
            parse_key_id(kid)
        except AuthFailed as exc:
            raise InvalidArgument(f"{where}: {exc.message}") from None
        return cls(kid, key)


Secret = bytes | Credential


def read_secret(path: str | Path) -> Secret:
    """A secret file's content: a credential (JSON from ``cachefs credential
    issue``) or the cluster secret itself (any other non-empty text).

    Raises:
        OSError: unreadable. InvalidArgument: empty, or a broken credential.
    """
    data = Path(path).read_bytes().strip()
    if not data:
        raise InvalidArgument(f"{path} is empty")
    if data.startswith(b"{"):
        return Credential.from_json(data.decode(errors="replace"), str(path))
    return data


def as_credential(secret: Secret | None, name: str = "cluster") -> Credential | None:
    """What a connecting side authenticates with: a credential as it is, or
    the cluster secret as the server credential ``server:<name>``."""
    if secret is None or isinstance(secret, Credential):
        return secret
    return Credential.server(secret, re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] or "cluster")


def check_role_for(identity: Identity, method: str, roles: frozenset[str]) -> None:
    if not identity.may(roles):
        raise PermissionDenied(f"{method} is not allowed for {identity} (needs {' or '.join(sorted(roles))})")
