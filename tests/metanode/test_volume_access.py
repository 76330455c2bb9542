"""Per-volume mount tokens: the state machine keeps a hash, mount_volume
checks it (EACCES), snapshots carry it, volumes without one stay open."""

from __future__ import annotations

import errno

import msgpack
import pytest
import zstandard

from cachefs.errors import CacheFSError, InvalidArgument
from cachefs.metanode import commands as C
from cachefs.metanode.namespace import MetaState, hash_token
from tests.metanode.test_service import Single, meta  # noqa: F401  (the fixture)

TOKEN = "s3cret-token-of-tenant-a"


def _state_with(token_hash: str) -> MetaState:
    s = MetaState()
    s.apply(1, C.CreateVolume("c", 1, 1, "t", "replica:1", "none", 1 << 20, 4, token_hash))
    s.apply(2, C.CreateVolume("c", 2, 1, "o", "replica:1", "none", 1 << 20, 4))
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
    s.apply(3, C.SetVolumeAccess("c", 3, 1, "o", hash_token("x")))
    with pytest.raises(CacheFSError):
        s.check_volume_token("o", None)
    s.apply(4, C.SetVolumeAccess("c", 4, 1, "t", ""))
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
        C.SetVolumeAccess("c", 1, 1, "t", "not-a-hash")
    old = msgpack.packb([C.CreateVolume.TAG, ["c", 1, 1, "v", "replica:1", "none", 1 << 20, 4]])
    assert C.decode(old).token_hash == ""
    cmd = C.CreateVolume("c", 1, 1, "v", "replica:1", "none", 1 << 20, 4, hash_token(TOKEN))
    assert C.decode(cmd.encode()) == cmd


async def test_mount_volume_needs_the_token(meta: Single) -> None:  # noqa: F811
    mc = meta.mc
    await mc.call(
        "create_volume", {"name": "sec", "policy": "replica:1", "token": TOKEN}, mutation=True
    )
    for args in ({}, {"token": "wrong"}):
        with pytest.raises(CacheFSError) as info:
            await mc.call(
                "mount_volume", {"volume": "sec", "client_id": "c1", **args}, mutation=True
            )
        assert info.value.errno == errno.EACCES and "sec" in str(info.value)
    ok = await mc.call(
        "mount_volume", {"volume": "sec", "client_id": "c1", "token": TOKEN}, mutation=True
    )
    assert ok["session"]
    assert (await mc.list_volumes())["sec"]["open"] is False
    # The fixture's volume was created without a token: open, no token needed.
    assert (await mc.mount_volume("v"))["session"]
    await mc.call("set_volume_access", {"name": "sec"}, mutation=True)
    assert (await mc.call("mount_volume", {"volume": "sec", "client_id": "c2"}, mutation=True))[
        "session"
    ]


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
        ("mount_volume", {"volume": "v", "client_id": "c", "token": 5}),
        ("create_volume", {"name": "w", "policy": "replica:1", "token": ["x"]}),
        ("set_volume_access", {"name": "v", "token": 3.5}),
    ]
    for method, args in calls:
        with pytest.raises(CacheFSError) as info:
            await mc.call(method, args, mutation=True)
        assert info.value.errno == errno.EINVAL and "token" in str(info.value)
    with pytest.raises(CacheFSError) as info:
        await mc.call("set_volume_access", {"name": "nope", "token": "t"}, mutation=True)
    assert info.value.errno == errno.ENOENT
    assert "w" not in meta.state.volumes and meta.state.volumes["v"].token_hash == ""
