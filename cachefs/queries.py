"""Typed queries: everything a client asks the metanodes that is not a log entry.

A query is a frozen class validated on construction, like a command
(:mod:`cachefs.commands`, in the shared core for the same reason), by the
client that builds it and by the leader that decodes it. The metanode serves each as the RPC method ``NAME``, whose one
argument ``a`` is the list of the query's fields in the order the class
declares them (:meth:`Query.to_wire`); ``REPLY`` decodes the answer at the
client (see :mod:`cachefs.messages`).

Two kinds:

- Reads of the replicated state: their ``run`` is the state-machine read
  the leader answers with, under its lease inline in the RPC reader (the
  hot path: ``getattr`` and ``lookup``), else after confirming leadership.
- The leader's soft state (``open``/``release``, heartbeats) and the cluster
  map, which the service answers through its hook table
  (``metanode.service.MetaService._QUERY_HOOKS``; a query with neither is
  refused when the service class is built).

Adding one: a class here with ``NAME``, ``REPLY``, its fields and ``run``;
MetaService registers it and ``MetaClient.query`` sends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic

from cachefs import messages as M
from cachefs.credentials import ADMINS, CLIENTS, SERVERS
from cachefs.errors import InvalidArgument
from cachefs.ids import REPO_SLICE_BIT
from cachefs.layout import Slice

from .commands import U32, R, body_getter, check_fields, check_int, check_name

if TYPE_CHECKING:  # the reads name the state machine's methods; no import at run time
    from cachefs.metanode.namespace import MetaState

MAX_READDIR = 10_000
MAX_TRASH_PAGE = 100_000
MAX_UNREFERENCED_ASK = 10_000  # each ask reads every file of the volume

QUERIES: dict[str, type[Query[Any]]] = {}  # RPC method name -> query


@dataclasses.dataclass(frozen=True, slots=True)
class Query(Generic[R]):
    """Base of every query; subclasses set ``NAME`` and ``REPLY`` and add
    fields, and ``ROLES`` unless it is for servers only (as ``Command``)."""

    NAME: ClassVar[str] = ""
    ROLES: ClassVar[frozenset[str]] = SERVERS
    REPLY: ClassVar[Callable[[Any], Any]] = M.nothing

    def __init_subclass__(cls, **kwargs: Any) -> None:
        del kwargs  # zero-arg super() breaks under slots, as in Command
        if "NAME" in cls.__dict__:
            QUERIES[cls.NAME] = cls  # the slots rebuild of the class replaces the first

    def __post_init__(self) -> None:
        check_fields(self)
        self.validate()

    def validate(self) -> None:
        """Range checks specific to the query; raise a CacheFSError."""

    def confine(self, answer: Any, volumes: frozenset[str]) -> Any:
        """What a client credential for ``volumes`` sees of ``answer``: all of
        it, unless the query answers about every volume (then only its own)."""
        del volumes
        return answer

    # A read also defines ``run(self, state: MetaState)``: the state-machine read
    # that answers it. The others have a hook in the service instead.

    def to_wire(self) -> tuple[Any, ...]:
        """The RPC argument ``a``: the fields in declaration order."""
        return body_getter(type(self))(self)

    @classmethod
    def from_wire(cls, a: list[Any]) -> Query[R]:
        try:
            return cls(*a)
        except TypeError as exc:
            raise InvalidArgument(f"bad {cls.NAME}: {exc}") from None


# -- namespace reads -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Lookup(Query[M.Attr]):
    NAME: ClassVar[str] = "lookup"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    parent: int
    name: bytes

    def validate(self) -> None:
        check_name(self.name)

    def run(self, state: MetaState) -> M.Attr:
        return state.lookup(self.volume, self.parent, self.name)


@dataclasses.dataclass(frozen=True, slots=True)
class GetAttr(Query[M.Attr]):
    NAME: ClassVar[str] = "getattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int

    def run(self, state: MetaState) -> M.Attr:
        return state.getattr(self.volume, self.ino)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadLink(Query[bytes]):
    NAME: ClassVar[str] = "readlink"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.blob
    volume: str
    ino: int

    def run(self, state: MetaState) -> bytes:
        return state.readlink(self.volume, self.ino)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadDir(Query[list[M.DirEntry]]):
    """Entries after ``cookie`` (0: from the start), at most ``limit`` (and
    at most ``MAX_READDIR``) of them; stable while entries come and go."""

    NAME: ClassVar[str] = "readdir"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.dir_entries
    volume: str
    ino: int
    cookie: int = 0
    limit: int = 1000

    def validate(self) -> None:
        check_int(self.cookie, "cookie")
        check_int(self.limit, "limit", 1)

    def run(self, state: MetaState) -> list[M.DirEntry]:
        return state.readdir(self.volume, self.ino, self.cookie, min(self.limit, MAX_READDIR))


@dataclasses.dataclass(frozen=True, slots=True)
class StatFs(Query[M.FsStats]):
    NAME: ClassVar[str] = "statfs"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.FsStats.from_wire
    volume: str

    def run(self, state: MetaState) -> M.FsStats:
        return state.statfs(self.volume)


@dataclasses.dataclass(frozen=True, slots=True)
class GetXattr(Query[bytes]):
    NAME: ClassVar[str] = "getxattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.blob
    volume: str
    ino: int
    name: bytes

    def run(self, state: MetaState) -> bytes:
        return state.getxattr(self.volume, self.ino, self.name)


@dataclasses.dataclass(frozen=True, slots=True)
class ListXattr(Query[list[bytes]]):
    NAME: ClassVar[str] = "listxattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.blobs
    volume: str
    ino: int

    def run(self, state: MetaState) -> list[bytes]:
        return state.listxattr(self.volume, self.ino)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadChunk(Query[list[Slice]]):
    """A chunk's slices in commit order, newest last."""

    NAME: ClassVar[str] = "read_chunk"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.slices
    volume: str
    ino: int
    chunk: int

    def validate(self) -> None:
        check_int(self.chunk, "chunk", 0, U32 - 1)

    def run(self, state: MetaState) -> list[tuple[int, int, int, int]]:
        return state.read_chunk(self.volume, self.ino, self.chunk)


@dataclasses.dataclass(frozen=True, slots=True)
class GetUsage(Query[M.Usage]):
    """A directory's subtree usage and quota."""

    NAME: ClassVar[str] = "get_usage"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Usage.from_wire
    volume: str
    ino: int

    def run(self, state: MetaState) -> M.Usage:
        return state.usage(self.volume, self.ino)


@dataclasses.dataclass(frozen=True, slots=True)
class ListQuotas(Query[list[dict[str, Any]]]):
    """Every directory of ``volume`` with a quota (``cachefs quota list``), as
    ``{inode, path (bytes), used_bytes, used_inodes, limit_bytes,
    limit_inodes}`` (a limit None: unlimited), in path order."""

    NAME: ClassVar[str] = "list_quotas"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping_list
    volume: str

    def run(self, state: MetaState) -> list[dict[str, Any]]:
        return state.quotas(self.volume)


@dataclasses.dataclass(frozen=True, slots=True)
class ListTreeDeletes(Query[list[dict[str, Any]]]):
    """The trees of ``volume`` being deleted (``cachefs tree delete``), as
    ``{ino, since_ns, inodes, left}``: inodes it held and has left."""

    NAME: ClassVar[str] = "list_tree_deletes"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping_list
    volume: str

    def run(self, state: MetaState) -> list[dict[str, Any]]:
        return state.tree_deletes(self.volume)


@dataclasses.dataclass(frozen=True, slots=True)
class ListTrash(Query[list[M.TrashEntry]]):
    """Unreferenced slices for the garbage collector, oldest first."""

    NAME: ClassVar[str] = "list_trash"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.trash_entries
    volume: str
    limit: int = 1000
    before_ns: int | None = None

    def run(self, state: MetaState) -> list[M.TrashEntry]:
        return state.trash(self.volume, max(1, min(self.limit, MAX_TRASH_PAGE)), self.before_ns)


@dataclasses.dataclass(frozen=True, slots=True)
class ListRepairs(Query[list[M.RepairEntry]]):
    """Blocks waiting to be brought back to full redundancy, oldest first."""

    NAME: ClassVar[str] = "list_repairs"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.repair_entries
    volume: str
    limit: int = 1000

    def run(self, state: MetaState) -> list[M.RepairEntry]:
        return state.repair_queue(self.volume, max(1, min(self.limit, MAX_TRASH_PAGE)))


@dataclasses.dataclass(frozen=True, slots=True)
class Unreferenced(Query[M.Unreferenced]):
    """Of ``slice_ids`` (found on datanodes), those below the commit floor
    (``SealSlices``) that no file and no trash entry of ``volume`` references:
    nothing can ever reference them again, so the collector deletes their
    blocks. One read of the state, so no rename or commit can slip between
    the files it looks at."""

    NAME: ClassVar[str] = "unreferenced_slices"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Unreferenced.from_wire
    volume: str
    slice_ids: tuple[int, ...]

    def validate(self) -> None:
        if len(self.slice_ids) > MAX_UNREFERENCED_ASK:
            raise InvalidArgument(f"at most {MAX_UNREFERENCED_ASK} slice ids per ask")

    def run(self, state: MetaState) -> M.Unreferenced:
        return state.unreferenced(self.volume, self.slice_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class DumpVolume(Query[bytes]):
    """A metadata backup of ``volume`` (``cachefs dump``): the leader
    serializes it in a forked child, a consistent view at one applied index
    that stops no writer (see ``metanode/backup.py``). Reply: the file's
    size; its bytes are the reply's payload (``MetaClient.call(full=True)``)."""

    NAME: ClassVar[str] = "dump_volume"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.integer
    volume: str


@dataclasses.dataclass(frozen=True, slots=True)
class CheckVolume(Query[list[str]]):
    """The metadata invariants of ``volume`` (``metanode/invariants.py``)
    checked on the leader's applied state (``cachefs fsck``): the problems
    found, empty when the namespace agrees with itself. The check walks the
    whole volume in one go on the leader, so it is for operators, not for
    every client."""

    NAME: ClassVar[str] = "check_volume"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.strings
    volume: str


@dataclasses.dataclass(frozen=True, slots=True)
class ListVolumes(Query[dict[str, Any]]):
    """``{name: {policy, compression, block_size, pg_count, used_bytes,
    used_inodes, open}}`` (the keys ``cachefs volume list --json`` prints);
    a deleted volume whose blocks are still being collected shows as
    ``{..., deleted: true}`` with no usage."""

    NAME: ClassVar[str] = "list_volumes"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping

    def run(self, state: MetaState) -> dict[str, Any]:
        out = {}
        for name, spec in state.cluster.volumes.items():
            if state.is_deleted(name):
                out[name] = {**spec.to_dict(), "deleted": True}
                continue
            stats = state.statfs(name)
            out[name] = {
                **spec.to_dict(),
                "used_bytes": stats.used_bytes,
                "used_inodes": stats.used_inodes,
                "open": not state.volumes[name].token_hash,
            }
        return out

    def confine(self, answer: dict[str, Any], volumes: frozenset[str]) -> dict[str, Any]:
        return {name: spec for name, spec in answer.items() if name in volumes}


@dataclasses.dataclass(frozen=True, slots=True)
class ListRepoLinks(Query[list[dict[str, Any]]]):
    """Every data repository link (``cachefs repo list --json``), in id order."""

    NAME: ClassVar[str] = "list_repo_links"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping_list

    def run(self, state: MetaState) -> list[dict[str, Any]]:
        return state.repo_links()


@dataclasses.dataclass(frozen=True, slots=True)
class RepoPending(Query[dict[str, Any]]):
    """The directories of link ``link_id`` not listed to the end yet:
    ``{prefix: cursor}`` (where an interrupted import of each goes on)."""

    NAME: ClassVar[str] = "repo_pending"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    link_id: int

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)

    def run(self, state: MetaState) -> dict[str, Any]:
        return state.repo_pending(self.link_id)


@dataclasses.dataclass(frozen=True, slots=True)
class RepoExports(Query[dict[str, Any]]):
    """The export queue of link ``link_id`` (``metanode/exports.py``): up to
    ``limit`` records, ``{deletes: [[key, gen, error, failed_ns]], puts:
    [[ino, key, gen, kind, error, failed_ns, queued_ns]], pending, failed, done}``."""

    NAME: ClassVar[str] = "repo_exports"
    ROLES: ClassVar[frozenset[str]] = ADMINS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    link_id: int
    limit: int = 1000

    def validate(self) -> None:
        check_int(self.link_id, "link_id", 1, U32)
        check_int(self.limit, "limit", 1, 10_000)

    def run(self, state: MetaState) -> dict[str, Any]:
        return state.repo_exports(self.link_id, self.limit)


@dataclasses.dataclass(frozen=True, slots=True)
class RepoObject(Query[dict[str, Any]]):
    """Where the blocks of repo slice ``slice_id`` come from: ``{link, key,
    etag, size, block_size}`` (``link`` as ``ListRepoLinks`` shows it). What a
    cache node (or a client reading around the cache tier) asks on a miss;
    the answer never changes, so it may be kept."""

    NAME: ClassVar[str] = "repo_object"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping
    volume: str
    slice_id: int

    def validate(self) -> None:
        check_int(self.slice_id, "slice_id", REPO_SLICE_BIT, (1 << 64) - 1)

    def run(self, state: MetaState) -> dict[str, Any]:
        return state.repo_object(self.volume, self.slice_id)


# -- answered by the service: the cluster map and the leader's soft state ------------


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterMap(Query[dict[str, Any]]):
    """The cluster map (docs/contracts.md), node liveness as this leader sees it."""

    NAME: ClassVar[str] = "cluster_map"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping

    def run(self, state: MetaState) -> dict[str, Any]:
        return state.cluster.to_dict()

    def confine(self, answer: dict[str, Any], volumes: frozenset[str]) -> dict[str, Any]:
        """The nodes (a client reads and writes them), its own volumes only."""
        return {
            **answer,
            "volumes": {n: v for n, v in answer["volumes"].items() if n in volumes},
            "pgs": {n: pgs for n, pgs in answer["pgs"].items() if n in volumes},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ListJobs(Query[list[dict[str, Any]]]):
    """The jobs (``cachefs warmup status``), oldest first, as ``Job.to_dict``
    (metanode/jobs.py); ``job_id`` 0: every job, else only that one (none if
    it is unknown). A client credential sees its own volumes' jobs only."""

    NAME: ClassVar[str] = "list_jobs"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.mapping_list
    job_id: int = 0

    def validate(self) -> None:
        check_int(self.job_id, "job_id")

    def run(self, state: MetaState) -> list[dict[str, Any]]:
        return state.jobs.listing(self.job_id)

    def confine(self, answer: list[dict[str, Any]], volumes: frozenset[str]) -> list[dict[str, Any]]:
        return [job for job in answer if job["volume"] in volumes]


@dataclasses.dataclass(frozen=True, slots=True)
class Open(Query[M.Attr]):
    """Count an open of a regular file by ``session``: leader soft state, no
    log entry (see ``metanode.opentable``); idempotent per session and inode.
    Reply: the inode's attributes as of then (a linearizable read)."""

    NAME: ClassVar[str] = "open"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.Attr.from_wire
    volume: str
    ino: int
    session: str


@dataclasses.dataclass(frozen=True, slots=True)
class Release(Query[None]):
    """Uncount an open (soft state); the last release of an orphan purges it."""

    NAME: ClassVar[str] = "release"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    volume: str
    ino: int
    session: str


@dataclasses.dataclass(frozen=True, slots=True)
class SessionHeartbeat(Query[bool]):
    """Keep a session alive; False: it is gone (remount). ``opens``: the
    inodes the session holds open, which a new leader learns this way."""

    NAME: ClassVar[str] = "session_heartbeat"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.boolean
    session: str
    opens: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class NodeHeartbeat(Query[None]):
    """A datanode or cache node is alive and holds ``used`` bytes (soft state)."""

    NAME: ClassVar[str] = "node_heartbeat"
    kind: str
    node_id: str
    used: int = 0

    def validate(self) -> None:
        check_int(self.used, "used")


# -- leases: reads that come with a lease, and the session's poll --------------------
# (answered by the service: a grant is leader soft state, metanode/leases.py)

SMALL_FILE = 4 << 20  # LoadDir sends chunk 0's slices of regular files up to this size


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseLookup(Query[M.LeasedAttr]):
    """``Lookup``, granting ``session`` leases on the directory (its entry
    ``name``) and the inode found."""

    NAME: ClassVar[str] = "lease_lookup"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.LeasedAttr.from_wire
    volume: str
    parent: int
    name: bytes
    session: str

    def validate(self) -> None:
        check_name(self.name)


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseGetAttr(Query[M.LeasedAttr]):
    """``GetAttr``, granting ``session`` a lease on the inode."""

    NAME: ClassVar[str] = "lease_getattr"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.LeasedAttr.from_wire
    volume: str
    ino: int
    session: str


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseOpen(Query[M.LeasedAttr]):
    """``Open`` (counted as an open of ``session``), granting a lease on the inode."""

    NAME: ClassVar[str] = "lease_open"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.LeasedAttr.from_wire
    volume: str
    ino: int
    session: str


@dataclasses.dataclass(frozen=True, slots=True)
class LoadDir(Query[M.DirLoad]):
    """A page of directory ``ino`` after ``cookie`` (at most ``limit`` and
    ``MAX_READDIR`` entries) with every entry's attributes, chunk 0's slice
    list of regular files up to ``small`` bytes (at most ``SMALL_FILE``; 0:
    none), and leases for ``session`` on the directory and the entries."""

    NAME: ClassVar[str] = "load_dir"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.DirLoad.from_wire
    volume: str
    ino: int
    session: str
    cookie: int = 0
    limit: int = 1000
    small: int = SMALL_FILE

    def validate(self) -> None:
        check_int(self.cookie, "cookie")
        check_int(self.limit, "limit", 1)
        check_int(self.small, "small")


@dataclasses.dataclass(frozen=True, slots=True)
class LeasePoll(Query[M.LeaseNews]):
    """The session's lease channel: acknowledges revocations (``acks``, by
    id), gives leases up (``drops``), reports which of those inodes it has
    open (``opens``), says the newest leader term it knows (``held_term``:
    it holds no lease of an older one, and takes none; 0: it knows none),
    and renews its leases. The leader answers at
    once when a revocation for the session is pending, else after at most
    ``wait_ms`` (and at most a quarter of the lease term)."""

    NAME: ClassVar[str] = "lease_poll"
    ROLES: ClassVar[frozenset[str]] = CLIENTS
    REPLY: ClassVar[Callable[[Any], Any]] = M.LeaseNews.from_wire
    session: str
    acks: tuple[int, ...] = ()
    drops: tuple[int, ...] = ()
    opens: tuple[int, ...] = ()
    held_term: int = 0
    wait_ms: int = 0

    def validate(self) -> None:
        check_int(self.held_term, "held_term")
        check_int(self.wait_ms, "wait_ms", 0, 60_000)
