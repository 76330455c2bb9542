"""Opening a volume for the native API, and saying why it could not be opened.

:func:`open_volume` connects the session (within ``connect_timeout``), runs
the engine and the filesystem in a nursery for the duration of its block,
and closes them at its end. A connect that timed out is explained
(:func:`_why_no_answer`): a metanode that refuses this client's TLS
certificate looks like a lost connection to the session, which retries until
the time is up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import ssl
import uuid
from collections.abc import AsyncIterator, Sequence

import trio

from cachefs.credentials import Credential
from cachefs.errors import AuthFailed, CacheFSError, ConnectionLost
from cachefs.rpc import RpcPool

from ..session import Session
from ..volume import ClientOptions, Volume
from .asyncfs import IDLE_INODES, AsyncFileSystem, _oserror

CONNECT_TIMEOUT = 10.0
PROBE_TIMEOUT = 5.0  # per metanode, when explaining a connect that timed out


def client_tls(
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
    tls_ca: str | os.PathLike[str] | None,
) -> ssl.SSLContext | None:
    """The client side of the mount's ``--tls-cert/--tls-key/--tls-ca`` (None: no TLS).

    The same loader as the daemons and the mount (all three files or none,
    checked before anything connects), with a ``ValueError`` naming the
    keyword arguments instead of the command line's usage error.
    """
    import click

    from cachefs.config import load_tls

    paths = [os.fspath(p) if p else None for p in (tls_cert, tls_key, tls_ca)]
    try:
        return load_tls(*paths)[1]
    except click.UsageError as exc:
        raise ValueError(f"cachefs: {exc.message.replace('--tls-', 'tls_')}") from None


@contextlib.asynccontextmanager
async def open_volume(
    meta_addrs: Sequence[str] | str,
    volume: str,
    *,
    secret: bytes | str | Credential | None = None,
    zone: str = "",
    options: ClientOptions | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    token: str | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    tls_context: ssl.SSLContext | None = None,
) -> AsyncIterator[AsyncFileSystem]:
    """Connect to ``volume`` for the duration of the block (trio-native).
    ``token``: the volume's mount token (an open volume needs none).
    ``tls_cert``/``tls_key``/``tls_ca``: PEM files for a TLS cluster, as
    the mount's ``--tls-*`` options (all three or none); ``tls_context``: an
    already made client context instead of the files.

    The client's own tasks (session upkeep, readahead, uploads) run in a
    nursery inside this block, so, as with any nursery, an exception leaving
    the block comes out in an ``ExceptionGroup``.

    Raises:
        OSError: the volume does not exist (ENOENT), the secret, the
            volume token or the TLS handshake was refused (EACCES), no
            metanode answered in ``connect_timeout`` (ETIMEDOUT).
        ValueError: an incomplete or unreadable set of TLS files.
    """
    addrs = _addrs(meta_addrs)
    options = options or ClientOptions()
    if tls_context is not None and any((tls_cert, tls_key, tls_ca)):
        raise ValueError("cachefs: give tls_context or the tls_cert/tls_key/tls_ca files, not both")
    tls = tls_context or client_tls(tls_cert, tls_key, tls_ca)
    failure: BaseException | None = None
    async with RpcPool(secret=_secret(secret), tls=tls) as pool:
        try:
            with trio.fail_after(connect_timeout):
                session = await Session.connect(
                    pool, addrs, volume, zone=zone, transport=options.transport,
                    client_id=f"api-{uuid.uuid4().hex[:12]}", token=token,
                    leases=False,  # answers come from the leader: nothing for a new one to wait for
                )  # fmt: skip
        except trio.TooSlowError:
            failure = await _why_no_answer(addrs, _secret(secret), tls, connect_timeout)
        except CacheFSError as exc:
            failure = _oserror(exc, f"cachefs:{volume}")
        else:
            async with trio.open_nursery() as nursery:
                fs = AsyncFileSystem(Volume(session, options, nursery=nursery, ghosts=IDLE_INODES))
                try:
                    yield fs
                finally:
                    with trio.CancelScope(shield=True):
                        await fs.aclose()
                    nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _why_no_answer(
    addrs: list[str], secret: bytes | None, tls: ssl.SSLContext | None, waited: float
) -> OSError:
    """The error for a connect that timed out.

    A metanode that refuses this client's TLS certificate ends each new
    connection right after the handshake, which the session takes for a lost
    connection and retries until the time is up. So ask every address once,
    all at the same time on a fresh pool, and name a refused certificate
    instead of a timeout.
    """
    refusals: list[OSError] = []

    async def probe(pool: RpcPool, addr: str) -> None:
        try:
            with trio.move_on_after(PROBE_TIMEOUT):
                await pool.call(addr, "health", timeout=PROBE_TIMEOUT)
        except AuthFailed as exc:  # the handshake itself refused (e.g. TLS 1.2)
            refusals.append(PermissionError(errno.EACCES, exc.message))
        except ConnectionLost as exc:
            if tls is not None and "TLS" in exc.message:
                refusals.append(PermissionError(
                    errno.EACCES,
                    f"the metanode at {addr} refused this client's TLS certificate "
                    f"({exc.message.strip()}); tls_cert must be signed by the cluster's CA",
                ))  # fmt: skip
        except CacheFSError:
            pass

    async with RpcPool(secret=secret, tls=tls) as pool, trio.open_nursery() as nursery:
        for addr in addrs:
            nursery.start_soon(probe, pool, addr)
    if refusals:
        return refusals[0]
    hint = "" if tls else " (a TLS cluster needs tls_cert, tls_key and tls_ca)"
    return TimeoutError(
        errno.ETIMEDOUT, f"no metanode at {','.join(addrs)} answered within {waited:.0f}s{hint}"
    )


def _addrs(meta_addrs: Sequence[str] | str) -> list[str]:
    addrs = meta_addrs.split(",") if isinstance(meta_addrs, str) else list(meta_addrs)
    addrs = [a.strip() for a in addrs if a.strip()]
    if not addrs:
        raise ValueError("no metanode addresses given")
    return addrs


def _secret(secret: bytes | str | Credential | None) -> bytes | Credential | None:
    if isinstance(secret, str):
        return secret.encode()
    return secret
