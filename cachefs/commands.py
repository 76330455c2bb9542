"""Typed commands: the metanodes' log entries, and the requests that make them.

They sit in the shared core beside the queries (:mod:`cachefs.queries`) and
the replies (:mod:`cachefs.messages`) because every part that changes
metadata builds them: the FUSE client, the garbage collector, node
registration, the admin CLI; the metanodes decode and apply them
(:mod:`cachefs.metanode.service`, :mod:`cachefs.metanode.namespace`).

Every change to the metadata is one of these frozen classes, encoded with
msgpack as ``[tag, [client_id, seq, now_ns, field, ...]]`` (the fields in the
order the class declares them) and replicated through Raft. A command is
validated when it is constructed: by the client that builds it, by the
leader that decodes the request (so a bad request is refused before it
reaches the log), and again when the state machine decodes the log entry (so
a malformed entry becomes an error result, never corrupt state).

A command with a ``NAME`` is a client request: the metanode serves it as the
RPC method of that name, whose one argument ``a`` is
``[client_id, seq, field, ...]`` (:meth:`Command.to_request`), and the reply
is decoded by the class's ``REPLY``. Commands without one (``PurgeOrphans``)
are proposed by the leader alone.

Clients' commands carry ``client_id`` and ``seq`` (``MetaClient`` fills them
in): the state machine answers a repeated ``(client_id, seq)`` with the first
answer instead of applying it again. The leader puts the sender's identity
(``Identity.tag``) before the ``client_id`` it sent, so one credential can
neither replay another's commands nor collect its answers, and a session
(named after its ``client_id``) belongs to the identity that mounted it.
Commands proposed by the metanodes themselves (session expiry, for example)
carry an empty ``client_id`` and are not deduplicated.

Who may send a command is its ``ROLES`` (servers only by default);
``metanode.service`` checks it, and the volumes and sessions a client names.

Time enters only as ``now_ns`` stamped by the leader that proposes the
command, so applying the same log on every replica gives the same state.
Fields documented as *leader-stamped* (``expect``/``keep`` of Unlink and
Rename, ``token_hash``) are likewise overwritten by the leader, whatever the
client sent.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import stat
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import msgpack

from cachefs import messages as M
from cachefs.backing.policy import VolumePolicy
from cachefs.credentials import ADMINS, CLIENTS, MAX_TAG, SERVERS
from cachefs.errors import FileTooLarge, InvalidArgument, NameTooLong, NotSupported
from cachefs.ids import CHUNK_SIZE, DEFAULT_BLOCK_SIZE
from cachefs.layout import MAX_FILE_SIZE

R = TypeVar("R")

NAME_MAX = 255
PATH_MAX = 4096
XATTR_NAME_MAX = 255
XATTR_VALUE_MAX = 64 * 1024
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
I64 = (1 << 63) - 1
MAX_SLICE_ALLOC = 1 << 20
MAX_SLICE_BLOCKS = CHUNK_SIZE // 4096  # a slice lies in one chunk; blocks are at least 4 KiB
MAX_CLIENT_ID = 128  # as sent; the leader puts "<identity tag>/" before it

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
XATTR_CREATE = 1
XATTR_REPLACE = 2

_FILE_TYPES = (stat.S_IFREG, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK)
_SLASH = ord("/")
_TOKEN_HASH = re.compile(r"[0-9a-f]{64}\Z")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_VOLUME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(name: bytes) -> bytes:
    """A directory entry name: 1..255 bytes, no ``/`` or NUL, not ``.``/``..``."""
    if not isinstance(name, bytes):
        raise InvalidArgument(f"name must be bytes, got {type(name).__name__}")
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name is {len(name)} bytes (max {NAME_MAX})")
    # an int in bytes is a byte search (~50 ns); a bytes in bytes takes the
    # buffer path (~500 ns), and this runs for every lookup on both ends
    if not name or name in (b".", b"..") or _SLASH in name or 0 in name:
        raise InvalidArgument(f"invalid name {name!r}")
    return name


def check_policy(
    policy: str, compression: str = "none", block_size: int = DEFAULT_BLOCK_SIZE
) -> str:
    """Validate a volume policy with the shared parser; returns its canonical text."""
    return str(VolumePolicy.parse(policy, compression, block_size))


def check_int(value: Any, what: str, lo: int = 0, hi: int = U64) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{what}={value} is out of range [{lo}, {hi}]")


_SIMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "bytes": (bytes,),
    "bool": (bool,),
}

_REGISTRY: dict[int, type[Command[Any]]] = {}
REQUESTS: dict[str, type[Command[Any]]] = {}  # RPC method name -> client command
_INT = (int,)
_HEADER = ("client_id", "seq", "now_ns")
Spec = tuple[str, str, tuple[type, ...] | None, bool]
_SPECS: dict[type, list[Spec]] = {}


def _specs(cls: type) -> list[Spec]:
    """(name, annotation, accepted types or None for int tuples, optional) per field,
    computed once per class: validation runs on every request, so it must be cheap."""
    specs = _SPECS.get(cls)
    if specs is None:
        specs = []
        for field in dataclasses.fields(cls):
            spec = str(field.type)
            base = spec.removesuffix(" | None")
            if base == "tuple[int, ...]":
                kinds = None
            elif base in _SIMPLE_TYPES:
                kinds = _INT if base == "int" else _SIMPLE_TYPES[base]
            else:  # pragma: no cover - a programming error in this module
                raise TypeError(f"unsupported field type {spec}")
            specs.append((field.name, spec, kinds, spec.endswith(" | None")))
        _SPECS[cls] = specs
    return specs


_WELL_TYPED: dict[type, Callable[[Any], bool]] = {}


def _well_typed(cls: type) -> Callable[[Any], bool]:
    """A test that every field holds exactly its annotated type, the common
    case, compiled once per class into one expression (this runs for every
    request: getattr's check went from 540 to about 100 ns). False sends the
    message through :func:`check_fields`'s full loop; classes with an int
    tuple always take it."""
    test = _WELL_TYPED.get(cls)
    if test is None:
        terms = []
        for name, _spec, kinds, optional in _specs(cls):
            if kinds is None:
                terms = ["False"]
                break
            term = f"type(m.{name}) is {kinds[0].__name__}"
            terms.append(f"(m.{name} is None or {term})" if optional else term)
        # the names are this module's own field names and builtin types
        test = eval(f"lambda m: {' and '.join(terms) or 'True'}", dict(_SIMPLE_BUILTINS))  # noqa: S307
        _WELL_TYPED[cls] = test
    return test


_SIMPLE_BUILTINS = {"int": int, "str": str, "bytes": bytes, "bool": bool}


def check_fields(message: Any) -> None:
    """Check every field of a frozen message against its annotation (``int``,
    ``str``, ``bytes``, ``bool``, ``tuple[int, ...]``, optionally ``| None``);
    a list given for an int tuple becomes a tuple. Shared with the queries."""
    if _well_typed(type(message))(message):
        return
    for name, spec, kinds, optional in _specs(type(message)):
        value = getattr(message, name)
        if value is None and optional:
            continue
        if kinds is None:  # tuple[int, ...]
            ok = isinstance(value, list | tuple) and all(
                type(v) is int or (isinstance(v, int) and not isinstance(v, bool)) for v in value
            )
            if ok and isinstance(value, list):
                object.__setattr__(message, name, tuple(value))
        else:
            ok = isinstance(value, kinds) and not (kinds is _INT and isinstance(value, bool))
        if not ok:
            raise InvalidArgument(
                f"{type(message).__name__}.{name} must be {spec}, got {type(value).__name__}"
            )


_BODIES: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def body_getter(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """Reads a message's own fields (not the command header), in declaration
    order; built once per class."""
    getter = _BODIES.get(cls)
    if getter is None:
        names = [f.name for f in dataclasses.fields(cls) if f.name not in _HEADER]
        if len(names) > 1:
            getter = operator.attrgetter(*names)
        elif names:
            one = operator.attrgetter(names[0])
            getter = lambda message: (one(message),)  # noqa: E731
        else:
            getter = lambda _message: ()  # noqa: E731
        _BODIES[cls] = getter
    return getter


@dataclasses.dataclass(frozen=True, slots=True)
class Command(Generic[R]):
    """Base of every log command; subclasses set ``TAG`` and add fields.

    ``NAME``: the RPC method a client sends it as ("" = the leader's own);
    ``ROLES``: the credential roles that may send it (servers only unless
    the class says otherwise; see :mod:`cachefs.credentials` and
    ``metanode.service``); ``REPLY``: decodes the apply result the client
    receives (see :mod:`cachefs.messages`).
    """

    TAG: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    ROLES: ClassVar[frozenset[str]] = SERVERS
    REPLY: ClassVar[Callable[[Any], Any]] = M.nothing
    MUTATES_VOLUME: ClassVar[bool] = True

    # the header: filled in by MetaClient (client_id, seq) and the leader (now_ns)
    client_id: str = dataclasses.field(default="", kw_only=True)
    seq: int = dataclasses.field(default=0, kw_only=True)
    now_ns: int = dataclasses.field(default=0, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        del kwargs  # Command has no base class options; zero-arg super() breaks under slots
        if "TAG" in cls.__dict__:
            # dataclass(slots=True) builds a second class of the same name: replace it
            old = _REGISTRY.get(cls.TAG)
            if old is not None and old.__qualname__ != cls.__qualname__:
                raise RuntimeError(f"duplicate command tag {cls.TAG}")
            _REGISTRY[cls.TAG] = cls
            if cls.NAME:
                REQUESTS[cls.NAME] = cls

    def __post_init__(self) -> None:
        check_fields(self)
        if len(self.client_id) > MAX_TAG + 1 + MAX_CLIENT_ID:  # as stamped by the leader
            raise InvalidArgument(f"client_id is longer than {MAX_TAG + 1 + MAX_CLIENT_ID} characters")
        check_int(self.seq, "seq")
        check_int(self.now_ns, "now_ns", 0, I64)
        self.validate()

    def validate(self) -> None:
        """Range checks specific to the command; raise a CacheFSError."""

    def encode(self) -> bytes:
        """The log entry."""
        values = [getattr(self, spec[0]) for spec in _specs(type(self))]
        values = [list(v) if isinstance(v, tuple) else v for v in values]
        return msgpack.packb([self.TAG, values], use_bin_type=True)

    def to_request(self, client_id: str, seq: int) -> list[Any]:
        """The RPC argument ``a``: ``[client_id, seq, field, ...]``."""
        return [client_id, seq, *body_getter(type(self))(self)]

    @classmethod
    def from_request(cls, a: list[Any], now_ns: int) -> Command[R]:
        """Decode and validate a client's request, stamped with the leader's clock."""
        if len(a) < 2:
            raise InvalidArgument(f"{cls.NAME or cls.__name__} needs [client_id, seq, field...]")
        try:
            return cls(*a[2:], client_id=a[0], seq=a[1], now_ns=now_ns)
        except TypeError as exc:
            raise InvalidArgument(f"bad {cls.NAME or cls.__name__}: {exc}") from None


# -- which inodes a command changes (for the leader's leases) -------------------------

# Read from a command's fields by name, so a new command is covered by naming
# its fields so: ``ino``/``inos``/``parent``/``new_parent`` are inodes it
# changes, ``(parent, name)`` and ``(new_parent, new_name)`` entries whose
# inode it changes (whatever they name when it applies). A command that
# changes other inodes must name them in such fields.
_INODE_FIELDS = ("ino", "parent", "new_parent")
_ENTRY_FIELDS = (("parent", "name"), ("new_parent", "new_name"))
Refs = tuple[str, tuple[int, ...], tuple[tuple[int, bytes], ...]]
_REF_GETTERS: dict[type, Callable[[Any], Refs | None]] = {}


def inode_refs(cmd: Command[Any]) -> Refs | None:
    """``(volume, inodes, entries)`` the command changes, or None if it
    changes no inode (volume, session and cluster commands)."""
    getter = _REF_GETTERS.get(type(cmd))
    if getter is None:
        getter = _REF_GETTERS[type(cmd)] = _ref_getter(type(cmd))
    return getter(cmd)


def _ref_getter(cls: type) -> Callable[[Any], Refs | None]:
    names = {f.name for f in dataclasses.fields(cls)}
    if "volume" not in names or not names & {*_INODE_FIELDS, "inos"}:
        return lambda _cmd: None
    inode_fields = [n for n in _INODE_FIELDS if n in names]
    entry_fields = [pair for pair in _ENTRY_FIELDS if set(pair) <= names]
    many = "inos" in names

    def refs(cmd: Any) -> Refs:
        inos = tuple(getattr(cmd, n) for n in inode_fields)
        if many:
            inos += tuple(cmd.inos)
        entries = tuple((getattr(cmd, p), getattr(cmd, n)) for p, n in entry_fields)
        return cmd.volume, inos, entries

    return refs


_REQUIRED: dict[type, int] = {}


def _required(cls: type) -> int:
    """Fields without a default: a log entry written before a field with a
    default was added still decodes (the default applies). Cached: every
    replica decodes every entry."""
    n = _REQUIRED.get(cls)
    if n is None:
        n = _REQUIRED[cls] = sum(
            1
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
    return n


def decode(raw: bytes) -> Command[Any]:
    """Decode and validate one log entry; raises InvalidArgument if malformed."""
    try:
        tag, values = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        raise InvalidArgument(f"undecodable command: {exc}") from None
    cls = _REGISTRY.get(tag) if isinstance(tag, int) else None
    if cls is None or not isinstance(values, list):
        raise InvalidArgument(f"unknown command tag {tag!r}")
    specs = _specs(cls)
    if not len(_HEADER) + _required(cls) <= len(values) <= len(specs):
        raise InvalidArgument(f"{cls.__name__} takes {len(specs)} fields")
    try:
        return cls(*values[3:], client_id=values[0], seq=values[1], now_ns=values[2])
    except TypeError as exc:
        raise InvalidArgument(f"bad {cls.__name__}: {exc}") from None


# -- volumes and sessions -------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CreateVolume(Command[dict[str, Any]]):
    """Reply: the volume's spec (as in the cluster map)."""

    TAG: ClassVar[int] = 1
    NAME: ClassVar[str] = "create_volume"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    name: str
    policy: str
    compression: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    pg_count: int = 64
    # Leader-stamped: sha256 hex of the request's mount token; "" = open (any
    # client with the cluster secret mounts it). The default keeps older log
    # entries open.
    token_hash: str = ""
    # "s3://bucket/prefix/": its blocks are objects there, not shards on the
    # datanodes (cachefs/backing/objects.py); endpoint and region of the store.
    backing: str = ""
    backing_endpoint: str = ""
    backing_region: str = ""

    def validate(self) -> None:
        _check_token_hash(self.token_hash)
        if self.backing:
            check_backing(self.backing, self.backing_endpoint, self.backing_region)
            if self.compression != "none":
                raise InvalidArgument(f"volume {self.name!r}: blocks in an object store are kept as they are "
                                      "(no --compression)")
        elif self.backing_endpoint or self.backing_region:
            raise InvalidArgument("an endpoint or region for the backing store needs --backing s3://BUCKET/PREFIX")
        if not _VOLUME_NAME.match(self.name):
            raise InvalidArgument(f"volume name {self.name!r}: use 1-64 of [A-Za-z0-9_.-]")
        check_int(self.block_size, "block_size", 4096, CHUNK_SIZE)
        if check_policy(self.policy, self.compression, self.block_size) != self.policy:
            raise InvalidArgument(f"write the policy as {check_policy(self.policy)!r}")
        if CHUNK_SIZE % self.block_size:
            raise InvalidArgument(f"block_size {self.block_size} must divide the 64 MiB chunk")
        check_int(self.pg_count, "pg_count", 1, 65536)


@dataclasses.dataclass(frozen=True, slots=True)
class SetVolumeCompression(Command[dict[str, Any]]):
    """Change a volume's compression for blocks written from now on; blocks
    describe their own encoding in their header, so old ones stay readable.
    (Redundancy and block size are fixed at creation: placement and the
    block keys of existing data depend on them.) Reply: the volume's spec."""

    TAG: ClassVar[int] = 4
    NAME: ClassVar[str] = "set_volume"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    name: str
    compression: str

    def validate(self) -> None:
        if self.compression not in ("none", "zstd"):
            raise InvalidArgument(f"compression must be none or zstd, got {self.compression!r}")


def _check_token_hash(value: str) -> None:
    if value and not _TOKEN_HASH.match(value):
        raise InvalidArgument("token_hash must be 64 lowercase hex digits (sha256) or empty")


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteVolume(Command[dict[str, Any]]):
    """``cachefs volume delete``: empty the volume in one entry and leave a
    tombstone. Every slice of every file goes to the volume's trash (the
    garbage collector deletes their blocks after the grace, and the leaks'
    with its sweeps), the namespace becomes an empty root, and the volume
    refuses mounts and every client call. EBUSY while sessions are open
    (mounted) unless ``force``, which closes them; EBUSY while a directory
    is linked to S3. ``DropVolume`` removes the tombstone once the trash is
    empty. Reply: ``{name, sessions_closed, slices_trashed}``."""

    TAG: ClassVar[int] = 53
    NAME: ClassVar[str] = "delete_volume"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    name: str
    force: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class DropVolume(Command[None]):
    """Forget a deleted volume whose trash is empty (its name is free again);
    the garbage collector sends it once a sweep finds none of its shards
    left on the datanodes. EBUSY while the trash holds slices."""

    TAG: ClassVar[int] = 54
    NAME: ClassVar[str] = "drop_volume"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    volume: str


@dataclasses.dataclass(frozen=True, slots=True)
class SetVolumeAccess(Command[dict[str, Any]]):
    """Set who may mount a volume: the request's token (leader-stamped as its
    sha256 hex), or none for open. Reply: ``{name, open}``."""

    TAG: ClassVar[int] = 42
    NAME: ClassVar[str] = "set_volume_access"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    name: str
    token_hash: str = ""

    def validate(self) -> None:
        _check_token_hash(self.token_hash)


@dataclasses.dataclass(frozen=True, slots=True)
class MountVolume(Command[M.MountInfo]):
    """Open a client session on a volume (its open files live in the session);
    the leader first checks the request's token against the volume's.
    ``leases``: whether the session may hold metadata leases (a FUSE mount).
    One that may not (the native API, the CLI's jobs) is never granted any,
    so a new leader need not wait for it to say it holds none."""

    TAG: ClassVar[int] = 2
    NAME: ClassVar[str] = "mount_volume"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.MountInfo.from_wire
    MUTATES_VOLUME: ClassVar[bool] = False
    volume: str
    leases: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class CloseSession(Command[None]):
    """End a session: on unmount, or proposed by the leader when it expires."""

    TAG: ClassVar[int] = 3
    NAME: ClassVar[str] = "close_session"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    MUTATES_VOLUME: ClassVar[bool] = False
    session: str


# -- namespace --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SetAttr(Command[M.Attr]):
    TAG: ClassVar[int] = 10
    NAME: ClassVar[str] = "setattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        if self.mode is not None:
            check_int(self.mode, "mode", 0, U32)
            # a chmod may carry the file type bits; nothing else
            if self.mode & ~(0o7777 | stat.S_IFMT(self.mode)):
                raise InvalidArgument(f"mode {self.mode:o} has unknown bits")
        for what in ("uid", "gid"):
            value = getattr(self, what)
            if value is not None:
                check_int(value, what, 0, U32)
        if self.size is not None:
            check_int(self.size, "size")
            if self.size > MAX_FILE_SIZE:  # truncate(2) says EFBIG
                raise FileTooLarge(f"size {self.size} is past the largest file ({MAX_FILE_SIZE})")
        for what in ("atime_ns", "mtime_ns"):
            value = getattr(self, what)
            if value is not None:
                check_int(value, what, 0, I64)


@dataclasses.dataclass(frozen=True, slots=True)
class Mknod(Command[M.Attr]):
    """Make a regular file (no type bits, or S_IFREG), device, fifo or socket."""

    TAG: ClassVar[int] = 11
    NAME: ClassVar[str] = "mknod"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    parent: int
    name: bytes
    mode: int
    rdev: int = 0
    uid: int = 0
    gid: int = 0

    def validate(self) -> None:
        check_int(self.parent, "parent", 1)
        check_name(self.name)
        check_int(self.mode, "mode", 0, U32)
        kind = stat.S_IFMT(self.mode)
        if kind and kind not in _FILE_TYPES:
            raise InvalidArgument(f"mknod cannot make file type {kind:o} (use mkdir/symlink)")
        if self.mode & ~(0o7777 | stat.S_IFMT(self.mode)):
            raise InvalidArgument(f"mode {self.mode:o} has unknown bits")
        check_int(self.rdev, "rdev", 0, U64)
        check_int(self.uid, "uid", 0, U32)
        check_int(self.gid, "gid", 0, U32)


@dataclasses.dataclass(frozen=True, slots=True)
class Mkdir(Command[M.Attr]):
    TAG: ClassVar[int] = 12
    NAME: ClassVar[str] = "mkdir"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    parent: int
    name: bytes
    mode: int
    uid: int = 0
    gid: int = 0

    def validate(self) -> None:
        check_int(self.parent, "parent", 1)
        check_name(self.name)
        check_int(self.mode, "mode", 0, U32)
        if stat.S_IFMT(self.mode) not in (0, stat.S_IFDIR):
            raise InvalidArgument(f"mkdir mode {self.mode:o} names another file type")
        if self.mode & ~(0o7777 | stat.S_IFDIR):
            raise InvalidArgument(f"mode {self.mode:o} has unknown bits")
        check_int(self.uid, "uid", 0, U32)
        check_int(self.gid, "gid", 0, U32)


@dataclasses.dataclass(frozen=True, slots=True)
class Symlink(Command[M.Attr]):
    TAG: ClassVar[int] = 13
    NAME: ClassVar[str] = "symlink"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    parent: int
    name: bytes
    target: bytes
    uid: int = 0
    gid: int = 0

    def validate(self) -> None:
        from cachefs.errors import NotFound

        check_int(self.parent, "parent", 1)
        check_name(self.name)
        if not self.target:
            raise NotFound("empty symlink target")
        if len(self.target) >= PATH_MAX:
            raise NameTooLong(f"symlink target is {len(self.target)} bytes (max {PATH_MAX - 1})")
        if b"\0" in self.target:
            raise InvalidArgument("symlink target contains NUL")
        check_int(self.uid, "uid", 0, U32)
        check_int(self.gid, "gid", 0, U32)


@dataclasses.dataclass(frozen=True, slots=True)
class Link(Command[M.Attr]):
    TAG: ClassVar[int] = 14
    NAME: ClassVar[str] = "link"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int
    new_parent: int
    new_name: bytes

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        check_int(self.new_parent, "new_parent", 1)
        check_name(self.new_name)


@dataclasses.dataclass(frozen=True, slots=True)
class Unlink(Command[M.Attr]):
    """``expect``/``keep`` (leader-stamped): whether the inode this drops is
    still open somewhere (see ``metanode.namespace.MetaState.keeps`` and
    ``metanode.opentable.OpenTable``). Answers the directory's attributes
    after the removal."""

    TAG: ClassVar[int] = 15
    NAME: ClassVar[str] = "unlink"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    parent: int
    name: bytes
    expect: int = 0
    keep: bool = False

    def validate(self) -> None:
        check_int(self.parent, "parent", 1)
        check_name(self.name)
        check_int(self.expect, "expect")


@dataclasses.dataclass(frozen=True, slots=True)
class Rmdir(Command[M.Attr]):
    """Answers the directory's attributes after the removal, as ``Unlink``."""

    TAG: ClassVar[int] = 16
    NAME: ClassVar[str] = "rmdir"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    parent: int
    name: bytes

    def validate(self) -> None:
        check_int(self.parent, "parent", 1)
        check_name(self.name)


@dataclasses.dataclass(frozen=True, slots=True)
class Rename(Command[M.Renamed | None]):
    TAG: ClassVar[int] = 17
    NAME: ClassVar[str] = "rename"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Renamed.from_wire
    volume: str
    parent: int
    name: bytes
    new_parent: int
    new_name: bytes
    flags: int = 0
    new_volume: str | None = None
    expect: int = 0  # leader-stamped for the replaced target, as in Unlink
    keep: bool = False

    def validate(self) -> None:
        check_int(self.parent, "parent", 1)
        check_int(self.new_parent, "new_parent", 1)
        check_int(self.expect, "expect")
        check_name(self.name)
        check_name(self.new_name)
        check_int(self.flags, "flags", 0, U32)
        if self.flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise InvalidArgument(f"unsupported rename flags {self.flags:#x}")
        if self.flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_NOREPLACE and RENAME_EXCHANGE together")


@dataclasses.dataclass(frozen=True, slots=True)
class SetXattr(Command[None]):
    TAG: ClassVar[int] = 18
    NAME: ClassVar[str] = "setxattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    volume: str
    ino: int
    name: bytes
    value: bytes
    flags: int = 0

    def validate(self) -> None:
        from cachefs.errors import Range

        check_int(self.ino, "ino", 1)
        if not self.name or len(self.name) > XATTR_NAME_MAX:
            raise Range(f"xattr name must be 1..{XATTR_NAME_MAX} bytes")
        if b"\0" in self.name:
            raise InvalidArgument("xattr name contains NUL")
        if len(self.value) > XATTR_VALUE_MAX:
            raise Range(f"xattr value is {len(self.value)} bytes (max {XATTR_VALUE_MAX})")
        check_int(self.flags, "flags", 0, XATTR_CREATE | XATTR_REPLACE)
        if self.flags == XATTR_CREATE | XATTR_REPLACE:
            raise InvalidArgument("XATTR_CREATE and XATTR_REPLACE together")


@dataclasses.dataclass(frozen=True, slots=True)
class RemoveXattr(Command[None]):
    TAG: ClassVar[int] = 19
    NAME: ClassVar[str] = "removexattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    volume: str
    ino: int
    name: bytes

    def validate(self) -> None:
        from cachefs.errors import Range

        check_int(self.ino, "ino", 1)
        if not self.name or len(self.name) > XATTR_NAME_MAX:
            raise Range(f"xattr name must be 1..{XATTR_NAME_MAX} bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class SetQuota(Command[M.Usage]):
    """Limit a directory subtree; ``None`` clears a limit, 0 forbids growth."""

    TAG: ClassVar[int] = 22
    NAME: ClassVar[str] = "set_quota"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Usage.from_wire
    volume: str
    ino: int
    max_bytes: int | None = None
    max_inodes: int | None = None

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        if self.max_bytes is not None:
            check_int(self.max_bytes, "max_bytes", 0, I64)
        if self.max_inodes is not None:
            check_int(self.max_inodes, "max_inodes", 0, I64)


# -- data -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class AllocSlices(Command[int]):
    """Reply: the first of ``count`` new slice ids."""

    TAG: ClassVar[int] = 30
    NAME: ClassVar[str] = "alloc_slices"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    MUTATES_VOLUME: ClassVar[bool] = False
    count: int = 1

    def validate(self) -> None:
        check_int(self.count, "count", 1, MAX_SLICE_ALLOC)


@dataclasses.dataclass(frozen=True, slots=True)
class WriteSlice(Command[M.Attr]):
    """Slice bytes ``[offset, offset+length)`` land at chunk position ``pos``;
    the size grows to cover them.

    ``short``: the slice's blocks that were stored with fewer than all their
    shards (a datanode was down); they join the volume's repair queue in the
    same log entry, so the record is exactly as durable as the commit.
    """

    TAG: ClassVar[int] = 31
    NAME: ClassVar[str] = "write_slice"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int
    chunk: int
    slice_id: int
    pos: int
    length: int
    offset: int
    mtime_ns: int
    short: tuple[int, ...] = ()

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        check_int(self.chunk, "chunk", 0, U32 - 1)
        check_int(self.slice_id, "slice_id", 1)
        check_int(self.pos, "pos", 0, CHUNK_SIZE - 1)
        check_int(self.length, "length", 1, CHUNK_SIZE)
        check_int(self.offset, "offset", 0, CHUNK_SIZE - 1)
        if self.pos + self.length > CHUNK_SIZE:
            raise InvalidArgument("slice runs past the end of its chunk")
        if self.offset + self.length > CHUNK_SIZE:
            raise InvalidArgument("slice offset + length is larger than a chunk")
        check_int(self.mtime_ns, "mtime_ns", 0, I64)
        check_short_blocks(self.short)


def check_short_blocks(indexes: tuple[int, ...]) -> None:
    """Block indexes of one slice: distinct, and below the most a slice can have."""
    if len(set(indexes)) != len(indexes):
        raise InvalidArgument("short names a block twice")
    for index in indexes:
        check_int(index, "short block index", 0, MAX_SLICE_BLOCKS - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class CompactChunk(Command[M.Attr]):
    """Swap a chunk's slices for one new slice, if they are still exactly ``expect``.

    The compactor read the chunk's records and wrote their merged content as
    ``slice_id`` covering ``[0, length)`` of the chunk, ``length`` being the
    end of the last record; it asks for an atomic swap. ``expect`` is every
    record as it read it, flat, ``(slice id, pos, length, offset)`` each, in
    commit order: a record added, cut by a truncate or replaced since makes
    the swap EBUSY (the new slice goes to the trash), and a ``length`` that
    is not where the records end is EINVAL. So a swap installs exactly the
    bytes the records held, and never drops another client's commit.
    """

    TAG: ClassVar[int] = 32
    NAME: ClassVar[str] = "compact_chunk"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int
    chunk: int
    expect: tuple[int, ...]
    slice_id: int
    length: int
    short: tuple[int, ...] = ()  # as WriteSlice's

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        check_int(self.chunk, "chunk", 0, U32 - 1)
        check_int(self.slice_id, "slice_id", 1)
        check_int(self.length, "length", 1, CHUNK_SIZE)
        if not self.expect or len(self.expect) % 4 or len(self.expect) > 400_000:
            raise InvalidArgument("expect must list the chunk's records: (slice id, pos, length, offset) each")
        check_short_blocks(self.short)

    def records(self) -> list[tuple[int, int, int, int]]:
        e = self.expect
        return [(e[i], e[i + 1], e[i + 2], e[i + 3]) for i in range(0, len(e), 4)]


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
FALLOCATE_MODES = (
    0,
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_ZERO_RANGE,
    FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Fallocate(Command[M.Attr]):
    """fallocate(2) on ``[offset, offset+length)`` as a change of the slice
    lists only, whatever the range's size, no byte written.

    ``mode`` 0 or ``FALLOC_FL_KEEP_SIZE``: the space must fit the quotas and
    the datanodes (EDQUOT/ENOSPC otherwise) but nothing is charged, since
    nothing is stored; without KEEP_SIZE the size grows to cover the range.
    ``PUNCH_HOLE|KEEP_SIZE`` and ``ZERO_RANGE`` (optionally with KEEP_SIZE):
    a hole record (slice 0) over the range inside the file in each chunk
    that holds records there, so it reads as zeros; records it covers go to
    the trash. ZERO_RANGE without KEEP_SIZE grows the size like mode 0.
    Other modes (COLLAPSE_RANGE, INSERT_RANGE, ...) are EOPNOTSUPP.
    """

    TAG: ClassVar[int] = 37
    NAME: ClassVar[str] = "fallocate"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int
    mode: int
    offset: int
    length: int

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        if self.mode not in FALLOCATE_MODES:
            raise NotSupported(f"fallocate mode {self.mode:#x} is not supported")
        check_int(self.offset, "offset", 0, I64)
        check_int(self.length, "length", 1, I64)
        if self.offset + self.length > MAX_FILE_SIZE:
            raise FileTooLarge(f"fallocate to {self.offset + self.length} is past the largest file ({MAX_FILE_SIZE})")


@dataclasses.dataclass(frozen=True, slots=True)
class PurgeTrash(Command[int]):
    """Forget trashed slices whose blocks the garbage collector has deleted;
    reply: how many were in the trash."""

    TAG: ClassVar[int] = 33
    NAME: ClassVar[str] = "purge_trash"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    volume: str
    slice_ids: tuple[int, ...]

    def validate(self) -> None:
        if len(self.slice_ids) > 100_000:
            raise InvalidArgument("at most 100000 slice ids per purge")


@dataclasses.dataclass(frozen=True, slots=True)
class PurgeOrphans(Command[int]):
    """Free unlinked inodes that were kept because they might be open; the
    leader proposes it once no session has them open (``metanode.opentable``).
    No ``NAME``: a client cannot send it."""

    TAG: ClassVar[int] = 34
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    volume: str
    inos: tuple[int, ...]

    def validate(self) -> None:
        if len(self.inos) > 100_000:
            raise InvalidArgument("at most 100000 inodes per purge")


@dataclasses.dataclass(frozen=True, slots=True)
class RepairsDone(Command[int]):
    """Blocks the leader's repair service brought back to full redundancy
    leave the repair queue; ``blocks`` is ``(slice_id, index)`` pairs, flat.
    No ``NAME``: a client cannot send it. Reply: how many were queued."""

    TAG: ClassVar[int] = 35
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    volume: str
    blocks: tuple[int, ...]

    def validate(self) -> None:
        if len(self.blocks) % 2 or len(self.blocks) > 200_000:
            raise InvalidArgument("blocks must be at most 100000 (slice_id, index) pairs")

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.blocks[::2], self.blocks[1::2], strict=True))


@dataclasses.dataclass(frozen=True, slots=True)
class SealSlices(Command[int]):
    """No slice id below ``floor`` may be committed from now on (``WriteSlice``
    and ``CompactChunk`` of one answer ``SliceExpired``), so the collector may
    delete the blocks of any such slice nothing references (``backing/gc.py``).
    The floor never goes down, nor past the next slice id. No ``NAME``: the
    leader's collector proposes it. Reply: the floor now."""

    TAG: ClassVar[int] = 36
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    floor: int

    def validate(self) -> None:
        check_int(self.floor, "floor", 0)


# -- data repositories (linked S3 prefixes, see cachefs.repo) -----------------------

IMPORT_MODES = ("full", "lazy")  # lazy: the leader lists a directory when it is first read
MAX_IMPORT_BATCH = 10_000
MAX_POLL_INTERVAL = 7 * 86400
MAX_OBJECT_KEY = 1024  # S3's limit, in UTF-8 bytes
EXPORT_EVENTS = ("new", "changed", "deleted")  # what --auto-export may name


def parse_auto_export(text: str) -> str:
    """``"new,changed,deleted"`` (any subset, any order, "" for none) in canonical order."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    bad = sorted(names - set(EXPORT_EVENTS))
    if bad:
        raise InvalidArgument(f"--auto-export takes a list of {','.join(EXPORT_EVENTS)}, got {', '.join(bad)}")
    return ",".join(e for e in EXPORT_EVENTS if e in names)


def check_repo_target(bucket: str, prefix: str, endpoint: str, region: str) -> None:
    """An S3 bucket name (3..63 of ``[a-z0-9.-]``), a key prefix and an optional endpoint URL."""
    if not _BUCKET.match(bucket):
        raise InvalidArgument(f"bucket name must be 3..63 of [a-z0-9.-], got {bucket!r}")
    if len(prefix.encode()) > MAX_OBJECT_KEY or prefix.startswith("/"):
        raise InvalidArgument(f"bad key prefix {prefix!r}")
    if endpoint and not re.match(r"https?://[^/\s]+/?\Z", endpoint):
        raise InvalidArgument(f"endpoint must be http(s)://host[:port], got {endpoint!r}")
    if len(region) > 64:
        raise InvalidArgument("region is longer than 64 characters")


def check_backing(url: str, endpoint: str, region: str) -> None:
    """A volume's object store, written canonically: ``s3://bucket/`` or ``s3://bucket/prefix/``."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not url.startswith("s3://") or (prefix and not prefix.endswith("/")) or "//" in prefix:
        raise InvalidArgument(f"backing must be written s3://BUCKET/ or s3://BUCKET/PREFIX/, got {url!r}")
    check_repo_target(bucket, prefix, endpoint, region)


@dataclasses.dataclass(frozen=True, slots=True)
class LinkRepo(Command[dict[str, Any]]):
    """Associate directory ``ino`` of ``volume`` with ``s3://bucket/prefix``;
    reply: the link (as ``ListRepoLinks`` shows it). Objects arrive by
    ``ImportObjects``; credentials never enter the metadata."""

    TAG: ClassVar[int] = 50
    NAME: ClassVar[str] = "link_repo"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    volume: str
    ino: int
    bucket: str
    prefix: str
    endpoint: str = ""
    region: str = ""
    import_mode: str = "full"
    auto_import: int = 0  # seconds between the leader's polls of the bucket; 0: only repo sync
    auto_export: str = ""  # which of EXPORT_EVENTS the leader exports to the bucket (comma-separated)

    def validate(self) -> None:
        check_int(self.ino, "ino", 1)
        check_repo_target(self.bucket, self.prefix, self.endpoint, self.region)
        if self.import_mode not in IMPORT_MODES:
            raise InvalidArgument(f"import mode must be one of {IMPORT_MODES}, got {self.import_mode!r}")
        check_int(self.auto_import, "auto_import (seconds)", 0, MAX_POLL_INTERVAL)
        if not isinstance(self.auto_export, str) or parse_auto_export(self.auto_export) != self.auto_export:
            raise InvalidArgument(f"auto_export must be a canonical list of {EXPORT_EVENTS}, got {self.auto_export!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class UnlinkRepo(Command[dict[str, Any]]):
    """Forget link ``link_id``; its imported files stay, but reading their
    S3 data then fails naming the removed link. Reply: the link as it was."""

    TAG: ClassVar[int] = 51
    NAME: ClassVar[str] = "unlink_repo"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    link_id: int

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)


@dataclasses.dataclass(frozen=True, slots=True)
class ImportObjects(Command[dict[str, int]]):
    """One page of a link's listing becomes files under its directory.

    ``entries`` is msgpack ``[[key, size, mtime_ns, etag], ...]``, keys
    relative to the link's prefix. A new key becomes a file (its missing
    directories too); a known key with another ETag gets a new content
    version (new block keys); a name held by a local file or a directory is
    left alone. Reply: ``{created, updated, unchanged, skipped, deleted}``.

    A page is of one directory's delimited listing: ``dir`` is its prefix
    relative to the link's ("" for the link's own directory, else ending in
    "/"), ``subdirs`` msgpack ``[prefix, ...]`` the page's common prefixes
    (each becomes a directory; a new one is *pending*, listed later),
    ``cursor`` the page's last key or prefix, where a resumed listing of
    ``dir`` starts, and ``done`` marks ``dir`` listed to the end (no longer
    pending). With ``prune``, the page speaks for every name of ``dir`` in
    ``(after, cursor]`` (to the end if ``done``): an imported file of this
    link there that the page does not list was deleted from the bucket and
    goes (kept as an orphan: it may be open), and so does such a directory,
    with every imported file under it (local files, and the directories
    holding them, stay).
    """

    TAG: ClassVar[int] = 52
    NAME: ClassVar[str] = "import_objects"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    link_id: int
    entries: bytes
    cursor: str = ""
    done: bool = False
    dir: str = ""
    subdirs: bytes = b""
    after: str = ""
    prune: bool = False

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)
        if self.dir and (not self.dir.endswith("/") or len(self.dir.encode()) > MAX_OBJECT_KEY):
            raise InvalidArgument(f"bad listed directory {self.dir!r}")
        for text, what in ((self.cursor, "cursor"), (self.after, "after")):
            if len(text.encode()) > MAX_OBJECT_KEY:
                raise InvalidArgument(f"{what} is longer than {MAX_OBJECT_KEY} bytes")
        self.objects()
        self.prefixes()

    def objects(self) -> list[tuple[str, int, int, str]]:
        """The decoded entries; InvalidArgument naming the first bad one."""
        rows = _unpack_list(self.entries, "import entries")
        out = []
        for row in rows:
            if type(row) is list and len(row) == 4:  # the common case, checked in one expression
                key, size, mtime, etag = row
                if (type(key) is str and type(size) is int and type(mtime) is int and type(etag) is str
                        and len(key) > 0 and len(key) * 4 <= MAX_OBJECT_KEY and len(etag) <= 256
                        and 0 <= size <= MAX_FILE_SIZE and 0 <= mtime <= I64):  # fmt: skip
                    out.append((key, size, mtime, etag))
                    continue
            if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
                    and isinstance(row[3], str) and len(row[3]) <= 256):  # fmt: skip
                raise InvalidArgument(f"import entry must be [key, size, mtime_ns, etag], got {row!r}")
            key, size, mtime, etag = row
            if not key or len(key.encode()) > MAX_OBJECT_KEY:
                raise InvalidArgument(f"bad object key {key!r}")
            check_int(size, f"size of {key!r}", 0, MAX_FILE_SIZE)
            check_int(mtime, f"mtime of {key!r}", 0, I64)
            out.append((key, size, mtime, etag))
        return out

    def prefixes(self) -> list[str]:
        """The decoded ``subdirs``: each a prefix of ``dir``'s, ending in "/"."""
        rows = _unpack_list(self.subdirs, "import subdirs") if self.subdirs else []
        for sub in rows:
            if not (isinstance(sub, str) and sub.startswith(self.dir) and sub.endswith("/")
                    and len(sub) > len(self.dir) + 1 and len(sub.encode()) <= MAX_OBJECT_KEY):  # fmt: skip
                raise InvalidArgument(f"subdir must be a prefix in {self.dir!r} ending in '/', got {sub!r}")
        return rows


@dataclasses.dataclass(frozen=True, slots=True)
class QueueExports(Command[dict[str, int]]):
    """``cachefs repo export``: queue every file of link ``link_id`` under
    ``path`` (relative to the link's directory, "" for all of it) whose
    content is not the bucket's (written or created in cachefs) for export,
    and make failed exports of the link pending again. The leader exports
    them (``metanode/exports.py``). Reply: ``{queued, retried}``."""

    TAG: ClassVar[int] = 55
    NAME: ClassVar[str] = "queue_repo_exports"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    link_id: int
    path: str = ""

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)
        if len(self.path.encode()) > MAX_OBJECT_KEY or self.path.startswith("/"):
            raise InvalidArgument(f"bad path in the link {self.path!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ReleaseFile(Command[dict[str, int]]):
    """``cachefs repo release``: file ``ino``, named ``name`` in directory
    ``parent`` under link ``link_id``, whose content at ``version`` is the
    object of its key with ``etag`` (the caller compared them), reads from
    then on from that object: its slices go to the trash (gc deletes their
    blocks from backing storage) and a repo slice of the object takes their
    place, as if it had been imported. Refused if the file changed since
    ``version``, was renamed, or has an export queued. Reply: ``{released:
    bytes no longer stored}``."""

    TAG: ClassVar[int] = 57
    NAME: ClassVar[str] = "repo_release_file"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    volume: str  # the link's (named, so leases on the file are revoked as for any change of it)
    link_id: int
    parent: int
    name: bytes
    ino: int
    version: int
    etag: str

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)
        check_int(self.parent, "parent", 1)
        check_int(self.ino, "ino", 1)
        check_int(self.version, "version", 0)
        check_name(self.name)
        if not self.etag or len(self.etag) > 256:
            raise InvalidArgument(f"bad ETag {self.etag!r}")


EXPORT_OUTCOMES = ("done", "failed", "dropped")


@dataclasses.dataclass(frozen=True, slots=True)
class ExportDone(Command[dict[str, bool]]):
    """The leader's exporter reports one export of link ``link_id``: the
    upload of file ``ino`` (or, with ``ino`` 0, the delete of ``key``) as
    queued at generation ``gen``. ``done`` takes the record off the queue,
    ``failed`` keeps it with ``error`` (shown by ``repo status``, tried
    again later), ``dropped`` takes it off without counting it (the file
    left the link). A record queued again since (a newer ``gen``) stays.
    Reply: ``{applied}``."""

    TAG: ClassVar[int] = 56
    NAME: ClassVar[str] = "repo_export_done"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    link_id: int
    ino: int
    key: str
    gen: int
    outcome: str = "done"
    error: str = ""

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)
        check_int(self.ino, "ino", 0)
        check_int(self.gen, "gen", 1)
        if len(self.key.encode()) > MAX_OBJECT_KEY or (not self.ino and not self.key):
            raise InvalidArgument(f"bad exported key {self.key!r}")
        if self.outcome not in EXPORT_OUTCOMES:
            raise InvalidArgument(f"export outcome must be one of {EXPORT_OUTCOMES}, got {self.outcome!r}")
        if len(self.error) > 1000:
            raise InvalidArgument("export error is longer than 1000 characters")


def _unpack_list(raw: bytes, what: str) -> list[Any]:
    try:
        rows = msgpack.unpackb(raw, raw=False, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidArgument(f"undecodable {what}: {exc}") from None
    if not isinstance(rows, list) or len(rows) > MAX_IMPORT_BATCH:
        raise InvalidArgument(f"{what} must be a list of at most {MAX_IMPORT_BATCH}")
    return rows


# -- cluster map --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RegisterNode(Command[int]):
    """Add or update a datanode or cache node; reply: the cluster map's epoch."""

    TAG: ClassVar[int] = 40
    NAME: ClassVar[str] = "register_node"
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    MUTATES_VOLUME: ClassVar[bool] = False
    kind: str
    node_id: str
    addr: str
    zone: str
    capacity: int

    def validate(self) -> None:
        if self.kind not in ("datanode", "cachenode"):
            raise InvalidArgument(f"kind must be datanode or cachenode, got {self.kind!r}")
        if not 1 <= len(self.node_id) <= 128:
            raise InvalidArgument("node id must be 1..128 characters")
        check_addr(self.addr)
        if not 1 <= len(self.zone) <= 64:
            raise InvalidArgument("zone must be 1..64 characters")
        check_int(self.capacity, "capacity", 0, I64)


@dataclasses.dataclass(frozen=True, slots=True)
class RemoveNode(Command[int]):
    TAG: ClassVar[int] = 41
    NAME: ClassVar[str] = "remove_node"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    MUTATES_VOLUME: ClassVar[bool] = False
    kind: str
    node_id: str

    def validate(self) -> None:
        if self.kind not in ("datanode", "cachenode"):
            raise InvalidArgument(f"kind must be datanode or cachenode, got {self.kind!r}")
        if not 1 <= len(self.node_id) <= 128:
            raise InvalidArgument("node id must be 1..128 characters")


@dataclasses.dataclass(frozen=True, slots=True)
class DrainNode(Command[dict[str, Any]]):
    """``cachefs datanode drain``: datanode ``node_id`` leaves the placement
    groups (``drain``) or comes back; its shards stay readable where they are
    until repair moves them (datanode/drain.py). Refused if too few datanodes
    would be left for a volume's policy. Reply: the node as the map shows it."""

    TAG: ClassVar[int] = 73
    NAME: ClassVar[str] = "drain_node"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    node_id: str
    drain: bool = True

    def validate(self) -> None:
        if not 1 <= len(self.node_id) <= 128:
            raise InvalidArgument("node id must be 1..128 characters")


# -- tree operations (cachefs tree clone / delete, see metanode/trees.py) ------------

MAX_TREE_BATCH = 10_000  # entries one command handles: bounds the time one apply takes


@dataclasses.dataclass(frozen=True, slots=True)
class CloneEntry(Command[dict[str, Any]]):
    """``cachefs tree clone``'s first step: ``src_parent/src_name`` is copied as
    ``new_parent/new_name`` without copying data. A file gets a new inode
    holding the same slice records (each slice gains a holder); a directory
    an empty one with the same attributes (``CloneDir`` fills it). Reply:
    ``{"ino", "is_dir", "bytes"}`` of the copy."""

    TAG: ClassVar[int] = 74
    NAME: ClassVar[str] = "clone_entry"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    volume: str
    src_parent: int  # not named parent/name: the source is read, not changed (no lease revoked)
    src_name: bytes
    new_parent: int
    new_name: bytes

    def validate(self) -> None:
        check_int(self.src_parent, "src_parent", 1)
        check_int(self.new_parent, "new_parent", 1)
        check_name(self.src_name)
        check_name(self.new_name)


@dataclasses.dataclass(frozen=True, slots=True)
class CloneDir(Command[dict[str, Any]]):
    """Copy the entries of directory ``src`` after readdir cookie ``cookie``,
    at most ``limit``, into the empty-so-far copy ``new_parent`` (as
    ``CloneEntry`` copies one). Reply: ``{"cookie"}`` to go on from (0: the
    directory is done), ``"entries"``, ``"bytes"`` and ``"dirs"``: the
    ``[source, copy]`` inode pairs of the subdirectories, still to fill."""

    TAG: ClassVar[int] = 75
    NAME: ClassVar[str] = "clone_dir"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    volume: str
    src: int
    new_parent: int
    cookie: int = 0
    limit: int = 1000

    def validate(self) -> None:
        check_int(self.src, "src", 1)
        check_int(self.new_parent, "new_parent", 1)
        check_int(self.cookie, "cookie")
        check_int(self.limit, "limit", 1, MAX_TREE_BATCH)


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteTree(Command[dict[str, Any]]):
    """``cachefs tree delete``: directory ``parent/name`` leaves the namespace
    at once (its usage with it) and is listed as being deleted; the leader
    then frees its inodes in ``PurgeTree`` steps, in the background. Reply:
    ``{"ino", "inodes"}``: the directory and how many inodes it holds, itself
    included (``ListTreeDeletes`` shows how many are left)."""

    TAG: ClassVar[int] = 76
    NAME: ClassVar[str] = "delete_tree"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    volume: str
    parent: int
    name: bytes

    def validate(self) -> None:
        check_int(self.parent, "parent", 1)
        check_name(self.name)


@dataclasses.dataclass(frozen=True, slots=True)
class PurgeTree(Command[int]):
    """Remove up to ``limit`` inodes of tree ``root`` being deleted, deepest
    first (the order is the state machine's: ``metanode/trees.py``). ``inos``
    (leader-stamped): what the leader expects it to remove, whose leases it
    revoked; ``free``: those of its files that no session has open: a file
    dropping its last link is freed only if listed, else kept as an orphan
    (as ``Unlink``'s ``keep``). No ``NAME``: the leader proposes it. Reply:
    how many inodes it removed."""

    TAG: ClassVar[int] = 77
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    volume: str
    root: int
    limit: int = 1000
    inos: tuple[int, ...] = ()
    free: tuple[int, ...] = ()

    def validate(self) -> None:
        check_int(self.root, "root", 1)
        check_int(self.limit, "limit", 1, MAX_TREE_BATCH)
        if len(self.inos) > 2 * MAX_TREE_BATCH or len(self.free) > MAX_TREE_BATCH:
            raise InvalidArgument(f"at most {MAX_TREE_BATCH} inodes per purge")


def check_addr(addr: str) -> str:
    """``host:port`` with a port in 1..65535."""
    host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"address must be host:port, got {addr!r}")
    return addr


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreVolume(Command[dict[str, Any]]):
    """Install a volume's metadata backup (``cachefs load``; the format is in
    ``metanode/backup.py``) into a cluster with no volume. The apply decodes
    and checks it: a bad or foreign file is EINVAL naming what is wrong, a
    cluster that holds a volume EEXIST. Reply: ``{volume, inodes, used_bytes}``."""

    # sent as ``MetaService.restore_volume`` (ADMINS), the backup as its payload
    TAG: ClassVar[int] = 43
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    blob: bytes


# -- jobs (``cachefs warmup --background``; metanode/jobs.py) ---------------------------

JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
JOB_FINISHED = ("done", "failed", "cancelled")
MAX_JOB_PATHS = 10_000
MAX_PIN_TTL = 366 * 86400
MAX_JOB_ERROR = 4096


def pack_strings(values: list[str] | tuple[str, ...]) -> bytes:
    """A list of strings as one ``bytes`` field (the codec's fields are scalars)."""
    return msgpack.packb(list(values), use_bin_type=True)


def unpack_strings(raw: bytes, what: str, limit: int) -> list[str]:
    try:
        values = msgpack.unpackb(raw, raw=False, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidArgument(f"undecodable {what}: {exc}") from None
    if not isinstance(values, list) or len(values) > limit or not all(isinstance(v, str) for v in values):
        raise InvalidArgument(f"{what} must be a list of at most {limit} strings")
    return values


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitJob(Command[dict[str, Any]]):
    """Queue a warm-up of ``paths`` (msgpack list of paths inside ``volume``)
    for the leader's job runner, in ``zones`` (msgpack list; empty: every
    zone), each block pinned for ``pin_ttl`` seconds after it is warmed (0:
    not pinned), ``threads`` batches at once. Reply: the job (``Job.to_dict``)."""

    TAG: ClassVar[int] = 70
    NAME: ClassVar[str] = "submit_job"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    volume: str
    paths: bytes
    zones: bytes = b"\x90"  # msgpack []
    pin_ttl: int = 0
    threads: int = 8

    def validate(self) -> None:
        paths = unpack_strings(self.paths, "paths", MAX_JOB_PATHS)
        if not paths:
            raise InvalidArgument("a job needs at least one path")
        for path in paths:
            if not 0 < len(path.encode("utf-8", "surrogateescape")) <= PATH_MAX:
                raise InvalidArgument(f"path must be 1..{PATH_MAX} bytes, got {path[:64]!r}")
        for zone in unpack_strings(self.zones, "zones", 64):
            if not 1 <= len(zone) <= 64:
                raise InvalidArgument("zone must be 1..64 characters")
        check_int(self.pin_ttl, "pin_ttl", 0, MAX_PIN_TTL)
        check_int(self.threads, "threads", 1, 1024)


@dataclasses.dataclass(frozen=True, slots=True)
class CancelJob(Command[dict[str, Any]]):
    """Cancel job ``job_id`` of ``volume`` (a finished job stays as it is);
    the runner stops at its next progress report. Reply: the job."""

    TAG: ClassVar[int] = 71
    NAME: ClassVar[str] = "cancel_job"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    MUTATES_VOLUME: ClassVar[bool] = False
    volume: str
    job_id: int

    def validate(self) -> None:
        check_int(self.job_id, "job_id", 1)


@dataclasses.dataclass(frozen=True, slots=True)
class JobProgress(Command[dict[str, Any]]):
    """The leader's runner reports on job ``job_id``: ``attempt`` (a new one
    starts the job again, after a failover), its ``state`` and counters.
    A report of an older attempt, or on a finished job, changes nothing.
    Reply: the job as it now stands."""

    TAG: ClassVar[int] = 72
    MUTATES_VOLUME: ClassVar[bool] = False
    job_id: int
    attempt: int
    state: str
    runner: int = 0
    files: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    blocks: int = 0
    cached: int = 0
    fetched: int = 0
    failed: int = 0
    error: str = ""

    def validate(self) -> None:
        check_int(self.job_id, "job_id", 1)
        check_int(self.attempt, "attempt", 1)
        if self.state not in JOB_STATES or self.state == "queued":
            raise InvalidArgument(f"state must be one of {', '.join(JOB_STATES[1:])}, got {self.state!r}")
        for name in ("runner", "files", "files_done", "bytes_total", "bytes_done", "blocks", "cached",
                     "fetched", "failed"):  # fmt: skip
            check_int(getattr(self, name), name, 0, I64)
        if len(self.error) > MAX_JOB_ERROR:
            raise InvalidArgument(f"error must be at most {MAX_JOB_ERROR} characters")
