"""Whether this machine can isolate code: the capability probe, and the backend a `Sandbox` gets (failing closed)."""

from __future__ import annotations

import errno
import functools
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .backends import BubblewrapBackend, LocalBackend, SandboxUnavailable, sandbox_python, sandbox_user
from .result import Limits
from .seccomp import SeccompUnavailable, denied, filter_program


@dataclass(frozen=True)
class Capability:
    """What the capability probe found: the backend that provides isolation here (None: none does) and why."""

    backend: str | None
    reason: str


def _userns_hint() -> str:
    checks = [
        ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1", "AppArmor restricts unprivileged user "
         "namespaces (Ubuntu ≥ 23.10). Allow them for bwrap with an AppArmor profile, or for the whole machine: "
         "`sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0`."),
        ("/proc/sys/kernel/unprivileged_userns_clone", "0", "unprivileged user namespaces are off "
         "(`sudo sysctl kernel.unprivileged_userns_clone=1`)."),
        ("/proc/sys/user/max_user_namespaces", "0", "user namespaces are off (`sudo sysctl user.max_user_namespaces="
         "15000`)."),
    ]  # fmt: skip
    for path, blocking_value, hint in checks:
        try:
            if Path(path).read_text().strip() == blocking_value:
                return hint
        except OSError:
            continue
    return (
        "User namespaces may be blocked by a container runtime's seccomp profile (Docker: run with "
        "`--security-opt seccomp=unconfined` or use a VM)."
    )


def make_backend(name: str, python: str | None = None):
    """Build a backend by name; the bubblewrap backend is probed first and refuses (fails closed) when unusable."""
    user = sandbox_user()
    if name == "local":
        return LocalBackend(python or sandbox_python(user), user)
    if name != "bubblewrap":
        raise ValueError(f"Unknown sandbox backend {name!r}: use 'bubblewrap' (isolated) or 'local' (not isolated).")
    capability = probe(python)
    if capability.backend != "bubblewrap":
        raise SandboxUnavailable(
            f"The bubblewrap sandbox is unavailable: {capability.reason} Code is not run without isolation unless "
            "you ask for it: backend='local' (or TRL_MARL_SANDBOX=local) runs it as a plain subprocess, which is not "
            "a security boundary (docs/sandbox.md)."
        )
    return BubblewrapBackend(shutil.which("bwrap"), python or sandbox_python(user), user)


@functools.cache
def probe(python: str | None = None) -> Capability:
    """Check, by running one program in the full bubblewrap profile, whether this machine can isolate code."""
    if not sys.platform.startswith("linux"):
        return Capability(None, f"bubblewrap needs Linux namespaces; this is {sys.platform}.")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Capability(
            None,
            "bubblewrap is not installed (`apt-get install bubblewrap`, `dnf install bubblewrap`, `pacman -S "
            "bubblewrap`).",
        )
    user = sandbox_user()
    try:
        filter_program()
        backend = BubblewrapBackend(bwrap, python or sandbox_python(user), user)
    except (SandboxUnavailable, SeccompUnavailable) as error:
        return Capability(None, str(error))
    limits = Limits(wall_time_s=10.0)
    job = {"mode": "program", "source": _PROBE_PROGRAM, "rlimits": {}}
    run = backend.run(job, None, limits)
    if run.refused and "Unknown option" in run.refused:
        return Capability(
            None,
            f"{bwrap} is too old ({run.refused}): the sandbox needs bubblewrap >= 0.8 (for --disable-userns). Install "
            "a newer one from your distribution's backports or build it from https://github.com/containers/bubblewrap.",
        )
    if run.refused:
        return Capability(None, f"bubblewrap refused to start a sandbox ({run.refused}). {_userns_hint()}")
    expected = f"{errno.EPERM} {limits.tmpfs_inodes} 0000000000000000\n".encode()
    if run.finished.returncode != 0 or run.finished.stdout != expected:
        return Capability(
            None,
            f"a probe program did not find the full profile inside bubblewrap (expected {expected!r}: the seccomp "
            f"filter's EPERM for vsock, the inode cap, no capabilities): {run.finished.stdout[-200:]!r} "
            f"{run.finished.stderr[-300:]!r}",
        )
    as_who = "as nobody" if user is not None else "as this user"
    return Capability(
        "bubblewrap",
        f"bubblewrap at {bwrap} isolates code here ({as_who}, Python {backend.python}; seccomp filter active: "
        f"{', '.join(denied())} denied).",
    )


# Runs in the full profile: proves the seccomp filter is applied (its EPERM comes before the kernel's own answer for
# vsock), the inode cap is set and no capability is left.
_PROBE_PROGRAM = """
import os, socket
try:
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    vsock = "allowed"
except OSError as error:
    vsock = error.errno
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(vsock, os.statvfs("/scratch").f_files, status["CapEff"].strip())
"""
