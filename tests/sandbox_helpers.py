"""Shared fixtures' helpers for the sandbox tests: finding sandbox processes, planting files, a sentinel process."""

import os
import time
from pathlib import Path


def sandbox_processes() -> set[int]:
    """Pids of processes that belong to a sandbox: running the harness, bubblewrap, or (when root) uid nobody."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            uid = int((entry / "status").read_text().split("\nUid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if b"harness.py" in cmdline or cmdline.startswith(b"bwrap") or b"/bwrap\0" in cmdline or uid == 65534:
            found.add(int(entry.name))
    return found


def wait_until_gone(pids_before: set[int], timeout_s: float = 5.0) -> set[int]:
    """Sandbox processes that appeared since ``pids_before`` and are still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = sandbox_processes() - pids_before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Contents of every file under ``directory`` (to prove nothing changed)."""
    return {str(path): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def require_bubblewrap() -> None:
    """Skip (with the probe's reason) when bubblewrap cannot isolate code here; fail instead under
    TRL_MARL_REQUIRE_BWRAP=1, as in CI, so that the isolation tests never silently go missing."""
    import pytest

    from trl_marl.sandbox import probe

    capability = probe()
    if capability.backend != "bubblewrap":
        if os.environ.get("TRL_MARL_REQUIRE_BWRAP") == "1":
            pytest.fail(f"TRL_MARL_REQUIRE_BWRAP=1 but bubblewrap is unusable: {capability.reason}")
        pytest.skip(f"bubblewrap cannot isolate code on this machine: {capability.reason}")
