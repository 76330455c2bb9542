"""The FUSE mounts of a bucket a user would pick instead of cachefs: rclone and s3fs, each with its disk cache.

Both come from Debian packages (``rclone``, ``s3fs``), installed when
missing as ``make deps`` installs its packages. Each mounts one prefix of a
bucket on a path-style S3 endpoint with the keys it is given; its disk
cache stays across mounts (both check an object's size and time, or ETag,
before serving a cached copy), so a fresh mount over a filled cache is the
peer's warm case.
"""

from __future__ import annotations

import abc
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def ensure_apt_packages(*packages: str) -> None:
    """Install the Debian ``packages`` not installed yet (needs root). apt's
    output goes to stderr: stdout is the benchmark's ``--json``."""
    missing = [p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=sys.stderr)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=sys.stderr)


class S3Mount(abc.ABC):
    """One FUSE mount of ``s3://bucket/prefix`` at ``workdir/name`` with its cache in ``workdir/name-cache``."""

    name = ""

    def __init__(self, workdir: Path, endpoint: str, bucket: str, prefix: str, access_key: str,
                 secret_key: str) -> None:  # fmt: skip
        self.workdir = workdir
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.access_key = access_key
        self.secret_key = secret_key
        self.mountpoint = workdir / self.name
        self.cache_dir = workdir / f"{self.name}-cache"
        self.log = workdir / f"{self.name}.log"

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command that mounts it (and returns once it is mounted, in the background)."""

    def mount(self, timeout: float = 60.0) -> Path:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            proc = subprocess.run(self.argv(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=self.env())
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if proc.returncode != 0 or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} mount failed ({proc.returncode}): "
                                   f"{self.log.read_text(errors='replace')[-1500:]}")
            time.sleep(0.1)
        return self.mountpoint

    def umount(self) -> None:
        if (os.path.ismount(self.mountpoint)
                and subprocess.run(["umount", str(self.mountpoint)], capture_output=True).returncode != 0):
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        deadline = time.monotonic() + 30  # the daemon writes its cache's state on the way out
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _running(self) -> bool:
        return subprocess.run(["pgrep", "-f", f"{self.name} .*{self.mountpoint}$"],
                              capture_output=True).returncode == 0

    def drop_cache(self) -> None:
        """Unmount, empty the disk cache and mount again: the next read crosses the link."""
        self.umount()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.mount()

    def remount(self) -> None:
        """A fresh mount over the disk cache as it is (the warm case)."""
        self.umount()
        self.mount()

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    @abc.abstractmethod
    def version(self) -> str:
        """What ran (for the report)."""


class Rclone(S3Mount):
    """``rclone mount --vfs-cache-mode full``: whole files cached on disk as they are read."""

    name = "rclone"

    def argv(self) -> list[str]:
        remote = (f":s3,provider=Other,access_key_id={self.access_key},secret_access_key={self.secret_key},"
                  f"endpoint='{self.endpoint}',region=us-east-1,force_path_style=true:{self.bucket}/{self.prefix}")
        return ["rclone", "mount", remote, str(self.mountpoint), "--daemon", "--vfs-cache-mode", "full",
                "--cache-dir", str(self.cache_dir), "--vfs-cache-max-age", "24h", "--log-file", str(self.log),
                "--config", "/dev/null"]

    def env(self) -> dict[str, str]:
        # rclone 1.60 fails to start with AWS_CA_BUNDLE set ("unsupported transport"); the endpoint is plain http
        return {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}

    def version(self) -> str:
        return subprocess.run(["rclone", "version"], capture_output=True, text=True).stdout.splitlines()[0]


class S3fs(S3Mount):
    """``s3fs -o use_cache=DIR``: whole objects cached on disk, checked against the bucket on open."""

    name = "s3fs"

    def argv(self) -> list[str]:
        passwd = self.workdir / "s3fs.passwd"
        passwd.write_text(f"{self.access_key}:{self.secret_key}\n")
        passwd.chmod(0o600)
        return ["s3fs", f"{self.bucket}:/{self.prefix}", str(self.mountpoint), "-o", f"passwd_file={passwd}",
                "-o", f"url={self.endpoint}", "-o", "use_path_request_style", "-o", "endpoint=us-east-1",
                "-o", f"use_cache={self.cache_dir}", "-o", f"logfile={self.log}"]

    def version(self) -> str:
        return subprocess.run(["s3fs", "--version"], capture_output=True, text=True).stdout.splitlines()[0]


PEERS = (Rclone, S3fs)
