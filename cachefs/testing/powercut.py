"""A disk that can lose power: the power-cut layer run as a process, for tests and the lab.

:class:`PowerCutDisk` mounts ``python -m cachefs.testing.powercutfs`` over a
directory (a daemon's data directory) with its durable state in another.
:meth:`PowerCutDisk.cut` is the power cut (kill -9 of the layer, so what was
not fsynced is gone, then the dead mount removed); :meth:`mount` again is
the reboot. The daemons using the directory must be dead before a cut
(kill -9 them first: a real power cut stops them too), or they keep open
files on the dead mount.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cachefs.testing.fuse import fuse_unavailable

FSTYPE = "fuse.powercut"


def supported() -> str:
    """Why the layer cannot run here, or "" when it can."""
    return fuse_unavailable() or ""


def is_mounted(path: str | os.PathLike[str], fstype: str = FSTYPE) -> bool:
    real = os.path.realpath(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[4] == real and fields[sep + 1] == fstype:
            return True
    return False


class PowerCutDisk:
    """One power-cut layer: ``mountpoint`` backed by ``backing`` (see the module doc)."""

    def __init__(self, backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str],
                 log_file: str | os.PathLike[str] | None = None) -> None:
        self.backing = Path(backing)
        self.mountpoint = Path(mountpoint)
        self.log_file = Path(log_file) if log_file else self.backing.with_name(self.backing.name + ".log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.cuts = 0

    @property
    def tree(self) -> Path:
        """The durable namespace: what the directory would hold after a power cut now."""
        return self.backing / "tree"

    def mount(self, timeout: float = 60.0) -> None:
        """Start the layer and wait until the mount answers (see :meth:`start`, :meth:`wait`)."""
        self.start()
        self.wait(timeout)

    def start(self) -> None:
        """Start the layer's process (booting several disks: start each, then wait for each)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.mountpoint}: the power-cut layer is already running")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cachefs.testing.powercutfs", str(self.backing), str(self.mountpoint)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout: float = 60.0) -> None:
        """Until the started layer is mounted.

        Raises:
            RuntimeError: the layer exited or did not mount within ``timeout``
                (a hang guard: under load a process alone can take 20 s to start).
        """
        if self.proc is None:
            raise RuntimeError(f"{self.mountpoint}: the power-cut layer was not started")
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mountpoint):
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                tail = self.log_file.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"power-cut layer on {self.mountpoint} exited with {code}: {tail}")
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"power-cut layer on {self.mountpoint} did not mount in {timeout:.0f}s")
            time.sleep(0.02)

    def cut(self) -> None:
        """The power cut: everything not fsynced is lost. Mount again to reboot."""
        self._kill()
        self.cuts += 1

    def unmount(self) -> None:
        """A clean shutdown: the layer syncs everything, then unmounts."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self._lazy_unmount()

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        self._lazy_unmount()

    def _lazy_unmount(self) -> None:
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False,
                           capture_output=True)
