"""The native API, fsspec and the torch Dataset against a lab that runs mutual TLS.

The lab is the real one (``LabConfig(tls=True)``: a throwaway CA and one
certificate per node made with openssl, every daemon started with its own),
small: 1 metanode, 3 datanodes (ec:2+1), 1 cache node. Reads and writes go
through every kind of link (metanode, datanodes, cache node) over TLS. A
client without TLS, trusting another CA, or showing a certificate of
another CA is refused with an error that says so; an incomplete set of TLS
files is refused before anything connects. A volume with a mount token
takes it through every entry point and refuses a wrong or missing one
(EACCES, naming the volume).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from cachefs.client.adapters.fsspec import CacheFSFileSystem
from cachefs.client.api import connect, open_volume
from cachefs.lab.cluster import Lab, LabConfig
from cachefs.lab.pki import make_pki
from cachefs.testing.ports import free_lab_base

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tenant-tls-token-7f3a"
SECURE = "tls-tenant"  # a volume that needs TOKEN

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
    reason="lab --tls needs the openssl command",
)


@pytest.fixture(scope="module")
def tls_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("tlslab")
    config = LabConfig(root=str(root), metanodes=1, datanodes=3, cachenodes=1, zones=3, policy="ec:2+1",
                       metrics=False, data_capacity="2G", cache_capacity="256M", cache_memory="16M", tls=True)
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        token_file = root / "token"
        token_file.write_text(TOKEN + "\n")
        made = subprocess.run(
            [sys.executable, "-m", "cachefs.cli", "volume", "create", SECURE, "--policy", "ec:2+1",
             "--token-file", str(token_file), "--meta", ",".join(lab.meta_addrs),
             "--secret-file", str(lab.secret_file), *lab.tls_args()],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        yield lab
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A client certificate and CA that have nothing to do with the lab's."""
    d = tmp_path_factory.mktemp("otherca")
    make_pki(d, {"client": "127.0.0.1"})
    return {"tls_cert": str(d / "client.pem"), "tls_key": str(d / "client-key.pem"),
            "tls_ca": str(d / "ca.pem")}  # fmt: skip


def test_the_lab_made_a_certificate_per_node(tls_lab: Lab) -> None:
    d = tls_lab.tls_dir
    for name in [n.name for n in tls_lab.nodes] + ["client"]:
        files = tls_lab.tls_files(name)
        assert Path(files["tls_cert"]).is_file() and Path(files["tls_key"]).is_file()
        assert stat.S_IMODE(os.stat(files["tls_key"]).st_mode) == 0o600
        text = subprocess.run(["openssl", "x509", "-in", files["tls_cert"], "-noout", "-text"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "IP Address:127.0.0.1" in text and f"CN = {name}" in text
    assert (d / "ca.pem").is_file() and not list(d.glob("*.csr"))
    assert tls_lab.tls_args()[::2] == ["--tls-cert", "--tls-key", "--tls-ca"]


def test_native_api_reads_and_writes_over_tls(tls_lab: Lab) -> None:
    data = os.urandom(3 << 20) + b"tail"
    with connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, zone="z1",
                 **tls_lab.tls_files()) as fs:  # fmt: skip
        fs.makedirs("/native", exist_ok=True)
        fs.write_bytes("/native/blob.bin", data)
        assert fs.stat("/native/blob.bin").st_size == len(data)
    # A second client (cold L1) reads it back from datanodes / the cache node.
    with connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, zone="z1",
                 **tls_lab.tls_files()) as fs:  # fmt: skip
        assert fs.read_bytes("/native/blob.bin") == data
        assert fs.read_bytes("/native/blob.bin", -4) == b"tail"
        assert fs.listdir("/native") == ["blob.bin"]


async def test_trio_native_open_volume_over_tls(tls_lab: Lab) -> None:
    async with open_volume(tls_lab.meta_addrs, "lab", secret=tls_lab.secret,
                           **tls_lab.tls_files()) as fs:  # fmt: skip
        await fs.makedirs("/trio", exist_ok=True)
        await fs.write_bytes("/trio/x", b"over tls")
        assert await fs.read_bytes("/trio/x") == b"over tls"


def test_fsspec_over_tls(tls_lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    cfs = fsspec.filesystem("cachefs", meta=",".join(tls_lab.meta_addrs),
                            secret_file=str(tls_lab.secret_file), skip_instance_cache=True,
                            **tls_lab.tls_files())  # fmt: skip
    try:
        cfs.pipe_file("lab/fsspec/a.bin", b"a" * 1000)
        assert cfs.cat_file("lab/fsspec/a.bin", 990) == b"a" * 10
        assert "lab" in cfs.ls("", detail=False)  # the volume list: a metanode call of its own
        with cfs.transaction, cfs.open("lab/fsspec/t.bin", "wb") as f:
            f.write(b"committed over tls")
        assert cfs.cat_file("lab/fsspec/t.bin") == b"committed over tls"
    finally:
        cfs.close()
    # The same files from the environment, as `cachefs mount` reads them.
    files = tls_lab.tls_files()
    monkeypatch.setenv("CACHEFS_META", ",".join(tls_lab.meta_addrs))
    monkeypatch.setenv("CACHEFS_SECRET_FILE", str(tls_lab.secret_file))
    for key, path in files.items():
        monkeypatch.setenv(f"CACHEFS_{key.upper()}", path)
    CacheFSFileSystem.clear_instance_cache()  # an instance cached by another test had other options
    of = fsspec.open("cachefs://lab/fsspec/a.bin", "rb")
    try:
        with of as f:
            assert f.read() == b"a" * 1000
    finally:
        of.fs.close()
        CacheFSFileSystem.clear_instance_cache()


def test_torch_dataset_over_tls(tls_lab: Lab) -> None:
    pytest.importorskip("torch")
    from cachefs.client.adapters.torch import CacheFSDataset

    with connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, **tls_lab.tls_files()) as fs:
        fs.makedirs("/ds", exist_ok=True)
        for i in range(4):
            fs.write_bytes(f"/ds/{i}.bin", bytes([i]) * 100)
    ds = CacheFSDataset(tls_lab.meta_addrs, "lab", "/ds", secret=tls_lab.secret,
                        **tls_lab.tls_files())  # fmt: skip
    try:
        assert [ds[i] for i in range(len(ds))] == [bytes([i]) * 100 for i in range(4)]
    finally:
        ds.close()
    # Each DataLoader worker opens its own TLS connection from the file paths.
    from cachefs.client.adapters.torch import make_loader

    ds = CacheFSDataset(tls_lab.meta_addrs, "lab", "/ds", secret=tls_lab.secret,
                        transform=_first_byte, **tls_lab.tls_files())  # fmt: skip
    try:
        loader = make_loader(ds, batch_size=1, shuffle=True, num_workers=2)
        assert sorted(int(i) for batch in loader for i in batch) == [0, 1, 2, 3]
    finally:
        ds.close()


def _first_byte(data: bytes) -> int:
    return data[0]


def test_a_client_without_tls_is_told_why(tls_lab: Lab) -> None:
    with pytest.raises(TimeoutError, match="TLS cluster needs tls_cert, tls_key and tls_ca"):
        connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, connect_timeout=2)


def test_a_client_trusting_another_ca_is_refused(tls_lab: Lab, other_ca: dict[str, str]) -> None:
    with pytest.raises(PermissionError, match="certificate verify failed") as info:
        connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, connect_timeout=5, **other_ca)
    assert info.value.errno == errno.EACCES


def test_a_certificate_of_another_ca_is_refused(tls_lab: Lab, other_ca: dict[str, str]) -> None:
    """Right CA trusted, wrong client certificate: the server ends the handshake."""
    files = {**other_ca, "tls_ca": tls_lab.tls_files()["tls_ca"]}
    with pytest.raises(PermissionError, match="refused this client's TLS certificate") as info:
        connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, connect_timeout=2, **files)
    assert info.value.errno == errno.EACCES


async def test_a_client_without_a_certificate_is_refused(tls_lab: Lab) -> None:
    from cachefs.rpc import client_tls

    ctx = client_tls(tls_lab.tls_files()["tls_ca"])  # trusts the lab, shows nothing
    with pytest.raises(PermissionError, match="refused this client's TLS certificate"):
        async with open_volume(tls_lab.meta_addrs, "lab", secret=tls_lab.secret,
                               connect_timeout=2, tls_context=ctx):  # fmt: skip
            pass


def test_an_incomplete_set_of_tls_files_is_refused_up_front(tls_lab: Lab, tmp_path: Path) -> None:
    files = tls_lab.tls_files()
    with pytest.raises(ValueError, match="missing tls_key, tls_ca"):
        connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret, tls_cert=files["tls_cert"])
    with pytest.raises(ValueError, match="tls_ca .*nowhere.pem"):
        connect(tls_lab.meta_addrs, "lab", secret=tls_lab.secret,
                **{**files, "tls_ca": str(tmp_path / "nowhere.pem")})  # fmt: skip
    with pytest.raises(ValueError, match="missing tls_cert"):
        CacheFSFileSystem(meta=tls_lab.meta_addrs, secret=tls_lab.secret, skip_instance_cache=True,
                          tls_key=files["tls_key"], tls_ca=files["tls_ca"])  # fmt: skip


# ---------------------------------------------------------------- volume tokens


def test_native_api_needs_the_volume_token(tls_lab: Lab) -> None:
    for bad in (None, "wrong-token"):
        with pytest.raises(PermissionError) as info:
            connect(tls_lab.meta_addrs, SECURE, secret=tls_lab.secret, token=bad,
                    **tls_lab.tls_files())  # fmt: skip
        assert info.value.errno == errno.EACCES and SECURE in str(info.value)
    with connect(tls_lab.meta_addrs, SECURE, secret=tls_lab.secret, token=TOKEN,
                 **tls_lab.tls_files()) as fs:  # fmt: skip
        fs.write_bytes("/t", b"tenant data")
        assert fs.read_bytes("/t") == b"tenant data"


def _cfs(lab: Lab, **options: object) -> CacheFSFileSystem:
    return CacheFSFileSystem(meta=lab.meta_addrs, secret=lab.secret, skip_instance_cache=True,
                             **lab.tls_files(), **options)  # fmt: skip


def test_fsspec_needs_the_volume_token(tls_lab: Lab, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.delenv("CACHEFS_TOKEN", raising=False)
    monkeypatch.delenv("CACHEFS_TOKEN_FILE", raising=False)
    for options in ({}, {"token": "wrong"}, {"token": {"lab": TOKEN}}):
        cfs = _cfs(tls_lab, **options)
        with pytest.raises(PermissionError) as info:
            cfs.cat_file(f"{SECURE}/t")
        assert info.value.errno == errno.EACCES and SECURE in str(info.value)
        assert cfs.cat_file("lab/fsspec/a.bin", 0, 1) == b"a"  # the open volume needs none
        cfs.close()
    for options in ({"token": TOKEN}, {"token": {SECURE: TOKEN}}, {"token_file": str(token_file)}):
        cfs = _cfs(tls_lab, **options)
        cfs.pipe_file(f"{SECURE}/via-fsspec", b"ok")
        assert cfs.cat_file(f"{SECURE}/via-fsspec") == b"ok"
        cfs.close()
    monkeypatch.setenv("CACHEFS_TOKEN_FILE", str(token_file))
    cfs = _cfs(tls_lab)
    assert cfs.cat_file(f"{SECURE}/via-fsspec") == b"ok"
    cfs.close()
    with pytest.raises(ValueError, match="token_file"):
        _cfs(tls_lab, token_file=str(tmp_path / "missing"))


def test_torch_dataset_needs_the_volume_token(tls_lab: Lab) -> None:
    pytest.importorskip("torch")
    from cachefs.client.adapters.torch import CacheFSDataset

    with connect(tls_lab.meta_addrs, SECURE, secret=tls_lab.secret, token=TOKEN,
                 **tls_lab.tls_files()) as fs:  # fmt: skip
        fs.makedirs("/samples", exist_ok=True)
        fs.write_bytes("/samples/0", b"zero")
    with pytest.raises(PermissionError) as info:
        CacheFSDataset(tls_lab.meta_addrs, SECURE, "/samples", secret=tls_lab.secret,
                       token="wrong", **tls_lab.tls_files())  # fmt: skip
    assert info.value.errno == errno.EACCES and SECURE in str(info.value)
    ds = CacheFSDataset(tls_lab.meta_addrs, SECURE, "/samples", secret=tls_lab.secret,
                        token=TOKEN, **tls_lab.tls_files())  # fmt: skip
    try:
        assert ds[0] == b"zero"
    finally:
        ds.close()


async def test_lab_status_over_tls(tls_lab: Lab) -> None:
    """`lab status` asks every daemon over TLS with the lab's client certificate."""
    status = await tls_lab.status()
    assert status["leader"] == tls_lab.meta_addrs[0]
    for node in status["nodes"]:
        assert node["alive"] and node["health"] and "error" not in node["health"], node
    assert status["cache"] and all("error" not in c for c in status["cache"])
