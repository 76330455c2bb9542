"""The security suite's own small lab (real processes, metrics on) and a FUSE mount of it."""

from __future__ import annotations

from tests.fuzz.conftest import lab, mnt  # noqa: F401 - session fixtures, one lab for this directory
