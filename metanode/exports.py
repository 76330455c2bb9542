"""The export queue of repository links: what the leader still has to upload to, or delete from, a bucket.

Theory of operation. Files of a linked directory are stored in cachefs
first (close() is unchanged); the queue says which of them the bucket does
not have yet. It is replicated state, so an acknowledged write whose
export is queued survives a mount's kill -9 and a metanode failover: the
record is made by the very log entry that commits the write.

- A *put* record, per inode: ``[gen, kind, error, failed_ns, queued_ns]``. It names
  the file, not its bytes or its path: the exporter reads the file's
  content and path when it exports, so a file written again or renamed
  before its export goes once, as it is then. ``kind`` is ``new`` (a file
  made in cachefs), ``changed`` (a file imported from the bucket, written
  since), ``export`` (queued by ``repo export``) or ``created`` (a new file
  nothing was written to yet: it waits ``CREATED_WAIT_NS`` for the write
  that usually follows, so a file is not exported empty first).
- A *delete* record, per object key: ``[gen, error, failed_ns]``, made
  when a file's name goes (unlink, rename) and the link exports
  ``deleted``.
- ``gen`` grows with every record queued (per link). The exporter reports
  ``ExportDone`` with the gen it read; a record queued again since keeps
  its newer gen and stays, so a write during an upload is exported after
  it, never lost. An upload done removes the delete records of its key
  queued before it (the exporter runs a pass's deletes first, so a name
  deleted and made again ends as the new file).
- ``failed``: the exporter's retries (tenacity, in ``cachefs.repo.exporter``)
  gave up. The record stays with the error, ``repo status`` shows it, the
  leader tries it again after ``RETRY_FAILED_NS`` and ``repo export``
  at once.

Which writes queue what (``--auto-export``): content changes (WriteSlice,
a truncating SetAttr) and creates (Mknod of a regular file) queue a put of
the kind the file is, if the link exports that kind (or if the file has
one queued already); Unlink and Rename queue a delete of the old key
with ``deleted``; a file renamed into (or inside) a link is queued as
``new`` at its new name. Not covered, by design of the cost: renaming a
directory does not re-export the files under it, and hard-linked files
(no one path) are not exported (``repo export`` reports them dropped).
Imports never queue anything: they are the bucket's own content.

The hooks cost one dict lookup per command when no link of the command's
volume exports, and a walk up the directory tree (as quota charging does)
when one does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cachefs import commands as C
from cachefs.errors import NotFound

from . import namespace as NS  # a cycle: used only at call time, namespace imports this module

if TYPE_CHECKING:
    from .namespace import Inode, MetaState, RepoLink, Volume

RETRY_FAILED_NS = 300 * 10**9  # a failed export is tried again by the leader after this long
CREATED_WAIT_NS = 5 * 10**9  # a created file not written to is exported after this long
HOOKED = frozenset({C.WriteSlice, C.SetAttr, C.Mknod, C.Unlink, C.Rename})
_S_IFMT, _S_IFREG = 0o170000, 0o100000


def index(state: MetaState) -> None:
    """Rebuild ``state.exporting`` ({volume: {directory ino: link}} of the links that export)."""
    state.exporting = {}
    for link in state.links.values():
        if link.auto_export:
            state.exporting.setdefault(link.volume, {})[link.ino] = link


def link_above(state: MetaState, vol: Volume, dir_ino: int) -> RepoLink | None:
    """The exporting link whose directory is ``dir_ino`` or holds it."""
    dirs = state.exporting.get(vol.name)
    if not dirs:
        return None
    for inode in state._ancestors(vol, dir_ino):
        link = dirs.get(inode.ino)
        if link is not None:
            return link
    return None


def _file(vol: Volume, ino: int | None) -> Inode | None:
    inode = vol.inodes.get(ino) if ino is not None else None
    return inode if inode is not None and inode.mode & _S_IFMT == _S_IFREG else None


def before(state: MetaState, cmd: Any) -> Any:
    """What :func:`after` needs to know from before ``cmd`` applies (None: nothing to queue)."""
    vol = state.volumes.get(cmd.volume)
    if vol is None or vol.name not in state.exporting:
        return None
    kind = type(cmd)
    if kind is C.WriteSlice or (kind is C.SetAttr and cmd.size is not None):
        inode = _file(vol, cmd.ino)
        if inode is None or not isinstance(inode.parent, int) or not inode.parent:
            return None
        link = link_above(state, vol, inode.parent)
        if link is None:
            return None
        # whether it is still the bucket's (a walk of its records): known already if queued or written
        return link, cmd.ino not in link.puts and cmd.ino not in link.written and link.owns(state, inode)
    if kind is C.Mknod:
        if cmd.mode & _S_IFMT not in (0, _S_IFREG) or cmd.parent not in vol.inodes:
            return None
        return link_above(state, vol, cmd.parent)
    if kind is C.Unlink:
        d = vol.inodes.get(cmd.parent)
        link = link_above(state, vol, cmd.parent) if d is not None and d.is_dir else None
        return None if link is None else (link, state._lookup_ino(d.data, cmd.name))
    if kind is C.Rename:
        src, dst = vol.inodes.get(cmd.parent), vol.inodes.get(cmd.new_parent)
        if src is None or dst is None or not src.is_dir or not dst.is_dir or cmd.flags & C.RENAME_EXCHANGE:
            return None
        old, new = link_above(state, vol, cmd.parent), link_above(state, vol, cmd.new_parent)
        if old is None and new is None:
            return None
        return old, new, state._lookup_ino(src.data, cmd.name), state._lookup_ino(dst.data, cmd.new_name)
    return None


def after(state: MetaState, cmd: Any, pre: Any, result: Any) -> None:
    """Queue what ``cmd`` (applied, with ``result``) asks of the exporting link ``pre`` names."""
    vol = state.volumes[cmd.volume]
    kind = type(cmd)
    if kind is C.WriteSlice or kind is C.SetAttr:
        link, owned = pre
        if owned:
            link.written.add(cmd.ino)
        queue_put(link, cmd.ino, "changed" if cmd.ino in link.written else "new", cmd.now_ns)
    elif kind is C.Mknod:
        queue_put(pre, result.ino, "created", cmd.now_ns)
    elif kind is C.Unlink:
        link, ino = pre
        _gone(link, vol, ino)
        if "deleted" in link.auto_export.split(","):
            key = key_of(state, vol, link, cmd.parent, cmd.name)
            if key is not None:
                queue_delete(link, key)
    else:  # Rename
        old, new, ino, replaced = pre
        if _file(vol, ino) is None:
            return  # a directory (not followed, see the module docstring) or a special file
        if replaced is not None and replaced != ino and new is not None:
            _gone(new, vol, replaced)
        if old is not None and "deleted" in old.auto_export.split(","):
            key = key_of(state, vol, old, cmd.parent, cmd.name)
            if key is not None:
                queue_delete(old, key)
        if old is not None and old is not new:
            old.puts.pop(ino, None)
            old.written.discard(ino)
        if new is not None:
            queue_put(new, ino, "new", cmd.now_ns)


def _gone(link: RepoLink, vol: Volume, ino: int | None) -> None:
    """Forget a file whose last name went (an open one may still be read, never exported)."""
    inode = vol.inodes.get(ino) if ino is not None else None
    if ino is not None and (inode is None or inode.nlink == 0):
        link.puts.pop(ino, None)
        link.written.discard(ino)


def queue_put(link: RepoLink, ino: int, kind: str, now_ns: int, *, force: bool = False) -> bool:
    """Queue (or queue again, with a new gen) the upload of file ``ino``."""
    event = "new" if kind == "created" else kind
    if not (force or ino in link.puts or event in link.auto_export.split(",")):
        return False
    link.export_gen += 1
    link.puts[ino] = [link.export_gen, kind, "", 0, now_ns]
    return True


def queue_delete(link: RepoLink, key: str) -> None:
    link.export_gen += 1
    link.deletes[key] = [link.export_gen, "", 0]


def key_of(state: MetaState, vol: Volume, link: RepoLink, dir_ino: int, name: bytes) -> str | None:
    """The object key of ``name`` in directory ``dir_ino`` under ``link``
    (None if it is not under it, or not UTF-8: S3 keys are)."""
    names = [name]
    for inode in state._ancestors(vol, dir_ino):
        if inode.ino == link.ino:
            try:
                return link.prefix + b"/".join(reversed(names)).decode()
            except UnicodeDecodeError:
                return None
        if not inode.parent:
            return None
        parent = vol.inodes[inode.parent]  # a directory has one parent
        names.append(next(n for n, packed in parent.data.entries.items() if packed & NS.INO_MASK == inode.ino))
    return None


def queue_dir(state: MetaState, link: RepoLink, path: str, now_ns: int) -> dict[str, int]:
    """``QueueExports``: every file under ``path`` whose content is not the
    bucket's; failed records become pending again."""
    vol = state.volumes.get(link.volume)
    top = state._walk(vol, link, path.strip("/") + "/" if path.strip("/") else "") if vol is not None else None
    if top is None or not top.is_dir:
        raise NotFound(f"no directory {path!r} in repository link {link.id}")
    retried = 0
    for rec in link.puts.values():
        retried += bool(rec[2])
        rec[2:4] = "", 0
    for rec in link.deletes.values():
        retried += bool(rec[1])
        rec[1], rec[2] = "", 0
    queued = 0
    stack = [top]
    while stack:
        d = stack.pop()
        for packed in d.data.entries.values():
            inode = vol.inodes[packed & NS.INO_MASK]
            if inode.is_dir:
                stack.append(inode)
            elif inode.mode & _S_IFMT == _S_IFREG and not link.owns(state, inode):
                queued += queue_put(link, inode.ino, "export", now_ns, force=True)
    return {"queued": queued, "retried": retried}


def export_done(link: RepoLink, cmd: C.ExportDone) -> dict[str, bool]:
    """``ExportDone``: see the module docstring."""
    queue: dict[Any, list[Any]] = link.puts if cmd.ino else link.deletes  # type: ignore[assignment]
    rec = queue.get(cmd.ino or cmd.key)
    if rec is None or rec[0] != cmd.gen:
        return {"applied": False}
    if cmd.outcome == "failed":
        at = 2 if cmd.ino else 1  # the error and failed_ns fields of either record
        rec[at : at + 2] = cmd.error or "failed", cmd.now_ns
        return {"applied": True}
    del queue[cmd.ino or cmd.key]
    if cmd.outcome == "done":
        link.exported += 1
        gone = cmd.key if cmd.ino else None
        if gone is not None and gone in link.deletes and link.deletes[gone][0] < cmd.gen:
            del link.deletes[gone]
    return {"applied": True}


def records(state: MetaState, link: RepoLink, limit: int, now_ns: int = 0) -> dict[str, Any]:
    """``RepoExports``: up to ``limit`` records, deletes first, puts with
    their file's key now ("" if it has none: hard-linked, moved out of the
    link, or not UTF-8); with ``now_ns``, only the ones due (not failed, or
    failed ``RETRY_FAILED_NS`` ago; not created, or created
    ``CREATED_WAIT_NS`` ago)."""
    vol = state.volumes.get(link.volume)

    def due(error: str, failed_ns: int) -> bool:
        return not now_ns or not error or now_ns - failed_ns >= RETRY_FAILED_NS

    deletes = [[key, *rec] for key, rec in link.deletes.items() if due(rec[1], rec[2])][:limit]
    puts: list[list[Any]] = []
    names: dict[int, dict[int, bytes]] = {}  # directory -> {ino: name}, each built once
    for ino, rec in link.puts.items():
        if len(deletes) + len(puts) >= limit:
            break
        if not due(rec[2], rec[3]) or (now_ns and rec[1] == "created" and now_ns - rec[4] < CREATED_WAIT_NS):
            continue
        inode = vol.inodes.get(ino) if vol is not None else None
        key = ""
        if inode is not None and isinstance(inode.parent, int) and inode.parent:
            byino = names.get(inode.parent)
            if byino is None:
                entries = vol.inodes[inode.parent].data.entries
                byino = names[inode.parent] = {packed & NS.INO_MASK: n for n, packed in entries.items()}
            key = key_of(state, vol, link, inode.parent, byino[ino]) or ""
        puts.append([ino, key, *rec])
    return {"deletes": deletes, "puts": puts, **link.to_dict()["exports"]}

