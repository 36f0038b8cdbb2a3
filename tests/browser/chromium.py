"""Debian's chromium for the browser tests: found on PATH, or installed with apt-get on first use (browser
downloads from elsewhere are not reachable from the test machines). A file lock keeps two xdist workers
from running apt at once."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser")


def _found() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name)) is not None), None)


def _apt(*args: str) -> None:
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run([*prefix, "apt-get", *args], env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"apt-get {' '.join(args)} failed (the browser tests need Debian's chromium):\n"
                    f"{result.stdout[-2000:]}{result.stderr[-2000:]}")  # fmt: skip


def chromium_path() -> str:
    """The chromium executable, installed first if need be."""
    with open(Path(tempfile.gettempdir()) / "folio-chromium-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _found()
        if found is None:
            _apt("update", "-qq")
            _apt("install", "-y", "-qq", "--no-install-recommends", "chromium")
            found = _found()
        if found is None:
            pytest.fail("apt-get installed chromium, yet no chromium is on PATH")
        return found
