"""Per-volume mount tokens: the state machine keeps a hash, mount_volume
checks it (EACCES), snapshots carry it, volumes without one stay open."""

from __future__ import annotations

import errno

import msgpack
import pytest
import zstandard

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError, InvalidArgument
from cachefs.metanode.namespace import MetaState, hash_token
from tests.metanode.test_service import Single, meta  # noqa: F401  (the fixture)

TOKEN = "s3cret-token-of-tenant-a"


def _state_with(token_hash: str) -> MetaState:
    s = MetaState()
    s.apply(1, C.CreateVolume("t", "replica:1", "none", 1 << 20, 4, token_hash, client_id="c", seq=1, now_ns=1))
    s.apply(2, C.CreateVolume("o", "replica:1", "none", 1 << 20, 4, client_id="c", seq=2, now_ns=1))
    return s


def test_state_keeps_a_hash_and_checks_it() -> None:
    s = _state_with(hash_token(TOKEN))
    assert s.volumes["t"].token_hash == hash_token(TOKEN) != TOKEN
    s.check_volume_token("t", TOKEN)
    for bad in (None, "", "wrong"):
        with pytest.raises(CacheFSError) as info:
            s.check_volume_token("t", bad)
        assert info.value.errno == errno.EACCES and "'t'" in str(info.value)
    s.check_volume_token("o", None)  # created without a token: open
    s.apply(3, C.SetVolumeAccess("o", hash_token("x"), client_id="c", seq=3, now_ns=1))
    with pytest.raises(CacheFSError):
        s.check_volume_token("o", None)
    s.apply(4, C.SetVolumeAccess("t", "", client_id="c", seq=4, now_ns=1))
    s.check_volume_token("t", None)


def test_snapshot_carries_the_hash_and_old_snapshots_restore() -> None:
    s = _state_with(hash_token(TOKEN))
    r = MetaState()
    r.restore(s.snapshot())
    assert r.volumes["t"].token_hash == hash_token(TOKEN) and r.volumes["o"].token_hash == ""
    # A snapshot written before the field existed: 7 fields per volume, restores open.
    state = msgpack.unpackb(
        zstandard.ZstdDecompressor().decompress(s.snapshot()), raw=False, strict_map_key=False
    )
    for vol in state[4]:
        del vol[7:]
    old = zstandard.ZstdCompressor().compress(msgpack.packb(state, use_bin_type=True))
    r2 = MetaState()
    r2.restore(old)
    assert r2.volumes["t"].token_hash == ""


def test_commands_validate_and_old_entries_decode() -> None:
    with pytest.raises(InvalidArgument):
        C.SetVolumeAccess("t", "not-a-hash", client_id="c", seq=1, now_ns=1)
    old = msgpack.packb([C.CreateVolume.TAG, ["c", 1, 1, "v", "replica:1", "none", 1 << 20, 4]])
    assert C.decode(old).token_hash == ""
    cmd = C.CreateVolume("v", "replica:1", "none", 1 << 20, 4, hash_token(TOKEN), client_id="c", seq=1, now_ns=1)
    assert C.decode(cmd.encode()) == cmd


async def test_mount_volume_needs_the_token(meta: Single) -> None:  # noqa: F811
    mc = meta.mc
    await mc.mutate(C.CreateVolume("sec", "replica:1"), token=TOKEN)
    for token in (None, "wrong"):
        with pytest.raises(CacheFSError) as info:
            await mc.mutate(C.MountVolume("sec"), token=token)
        assert info.value.errno == errno.EACCES and "sec" in str(info.value)
    assert (await mc.mutate(C.MountVolume("sec"), token=TOKEN)).session
    assert (await mc.query(Q.ListVolumes()))["sec"]["open"] is False
    # The fixture's volume was created without a token: open, no token needed.
    assert (await mc.mount_volume("v")).session
    await mc.mutate(C.SetVolumeAccess("sec"))
    assert (await mc.mutate(C.MountVolume("sec"))).session


async def test_the_leader_stamps_the_token_hash(meta: Single) -> None:  # noqa: F811
    """A client cannot plant a hash of its choosing: the leader hashes the
    request's token (none: an open volume) over whatever the command held."""
    mc = meta.mc
    await mc.mutate(C.CreateVolume("planted", "replica:1", token_hash=hash_token("mine")))
    assert meta.state.volumes["planted"].token_hash == ""
    await mc.mutate(C.SetVolumeAccess("planted", hash_token("mine")), token=TOKEN)
    assert meta.state.volumes["planted"].token_hash == hash_token(TOKEN)


def test_cli_access_options_are_checked_before_connecting(tmp_path) -> None:
    from click.testing import CliRunner

    from cachefs.metanode.admin import volume

    token, empty = tmp_path / "t", tmp_path / "e"
    token.write_text("x\n")
    empty.write_text("\n")
    common = ["--meta", "127.0.0.1:1", "--insecure"]
    runner = CliRunner()
    both = runner.invoke(volume, ["create", "v", "--token-file", str(token), "--open", *common])
    assert both.exit_code == 2 and "not both" in both.output
    nothing = runner.invoke(volume, ["set", "v", *common])
    assert nothing.exit_code == 2 and "nothing to set" in nothing.output
    blank = runner.invoke(volume, ["set", "v", "--token-file", str(empty), *common])
    assert blank.exit_code == 2 and "empty" in blank.output


async def test_token_arguments_are_typed(meta: Single) -> None:  # noqa: F811
    mc = meta.mc
    calls = [
        ("mount_volume", ["c", 1, "v"], 5),
        ("create_volume", ["c", 2, "w", "replica:1"], ["x"]),
        ("set_volume_access", ["c", 3, "v"], 3.5),
    ]
    for method, a, token in calls:
        with pytest.raises(CacheFSError) as info:
            await mc.call(method, {"a": a, "token": token})
        assert info.value.errno == errno.EINVAL and "token" in str(info.value)
    with pytest.raises(CacheFSError) as info:
        await mc.mutate(C.Mkdir("v", 1, b"d", 0o755), token="t")
    assert info.value.errno == errno.EINVAL and "token" in str(info.value)
    with pytest.raises(CacheFSError) as info:
        await mc.mutate(C.SetVolumeAccess("nope"), token="t")
    assert info.value.errno == errno.ENOENT
    assert "w" not in meta.state.volumes and meta.state.volumes["v"].token_hash == ""
    assert meta.state.volumes["v"].inodes.keys() == {1}
