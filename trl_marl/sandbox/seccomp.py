"""The seccomp filter bubblewrap applies to every sandbox (``--seccomp FD``), compiled by libseccomp.

Namespaces do not isolate everything: the kernel keyrings, vsock and the SysV IPC objects of the sandbox's own IPC
namespace stay reachable from inside. The filter denies those system calls (they fail with ``EPERM``) and lets every
other one through. libseccomp, the library systemd, Docker and Flatpak build their filters with, compiles the rules
into a BPF program for this machine's architecture; no BPF is written here. It is called through ``ctypes`` because its
Python bindings come as a distribution package for the system interpreter only, out of reach of a virtual
environment, while ``libseccomp.so.2`` itself is on every distribution that ships systemd.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import socket

# Each denied call, by what it reaches (docs/sandbox.md, "What seccomp adds").
DENIED = {
    # Kernel keyrings are not namespaced: the trainer's session keyring would be readable and writable.
    "keyctl": "keyrings",
    "add_key": "keyrings",
    "request_key": "keyrings",
    # SysV IPC objects outlive the process that made them and count against no rlimit (nor against any process, for
    # the OOM killer); on 32-bit x86 and s390 they are reached through the `ipc` multiplexer.
    "shmget": "SysV IPC",
    "msgget": "SysV IPC",
    "semget": "SysV IPC",
    "ipc": "SysV IPC",
    # Memory behind a file descriptor, outside RLIMIT_AS until it is mapped.
    "memfd_create": "memfd",
    "memfd_secret": "memfd",
    # io_uring runs its operations (socket creation included) without passing through this filter.
    "io_uring_setup": "io_uring",
    "io_uring_enter": "io_uring",
    "io_uring_register": "io_uring",
    # Kernel attack surface no candidate needs.
    "bpf": "bpf",
    "perf_event_open": "perf events",
    "userfaultfd": "userfaultfd",
}
# Sockets of every family but AF_UNIX. The network namespace does not isolate vsock (a sandbox could reach the VM's
# host: Firecracker, Kata, Nitro), and TCP grows its buffers by itself up to `net.ipv4.tcp_rmem`/`tcp_wmem` (32 MiB a
# socket on some hosts), memory that no limit counts and that the host's TCP shares: 16 processes held 1.45 GiB in
# the sandbox's own loopback. Within a network namespace that has nothing but its loopback, no candidate needs them.
SOCKET_FAMILY = socket.AF_UNIX  # the only one allowed
# Calls denied for some arguments only: (call, {argument index: value}, what it reaches). Arguments are compared on
# their low 32 bits, as the kernel reads an int.
DENIED_WITH = [
    # Buffers past the kernel's default size: data in flight, which no limit counts, could take up to
    # `net.core.wmem_max` a socket (4 MiB on hosts tuned for throughput) instead of `wmem_default` (208 KiB), and up to
    # `fs.pipe-max-size` a pipe (1 MiB) instead of 64 KiB.
    *(("setsockopt", {1: socket.SOL_SOCKET, 2: option}, "socket buffer sizes") for option in (7, 8, 32, 33)),
    *((name, {1: 1031}, "pipe buffer sizes") for name in ("fcntl", "fcntl64")),  # F_SETPIPE_SZ
]

_ALLOW = 0x7FFF0000  # SCMP_ACT_ALLOW
_DENY = 0x00050000 | errno.EPERM  # SCMP_ACT_ERRNO(EPERM)
_NE, _MASKED_EQ = 1, 7  # SCMP_CMP_NE, SCMP_CMP_MASKED_EQ


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused the rules; the sandbox does not run without the filter."""


class _ArgCompare(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        library = ctypes.CDLL(name, use_errno=True)
    except OSError as error:
        raise SeccompUnavailable(
            f"libseccomp is not installed ({error}): install it (`apt-get install libseccomp2`, `dnf install "
            "libseccomp`, `pacman -S libseccomp`)."
        ) from None
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCompare),
    ]
    library.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return library


def denied() -> list[str]:
    """What the filter denies, in words."""
    labels = [*DENIED.values(), "sockets but AF_UNIX", *(label for *_, label in DENIED_WITH)]
    return list(dict.fromkeys(labels))


@functools.cache
def filter_program() -> bytes:
    """The compiled filter (a ``struct sock_filter`` array, as ``bwrap --seccomp`` reads it). Raises
    SeccompUnavailable when libseccomp is missing or cannot compile it."""
    library = _library()
    context = library.seccomp_init(_ALLOW)
    if not context:
        raise SeccompUnavailable("libseccomp could not start a filter (seccomp_init failed).")
    try:

        def deny(name: str, *conditions: _ArgCompare) -> None:
            number = library.seccomp_syscall_resolve_name(name.encode())
            if number == -1:  # __NR_SCMP_ERROR: a name this libseccomp does not know
                return
            # A call this architecture does not have resolves to a negative pseudo-number, which libseccomp skips.
            array = (_ArgCompare * len(conditions))(*conditions) if conditions else None
            result = library.seccomp_rule_add_array(context, _DENY, number, len(conditions), array)
            if result != 0:
                raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-result)}.")

        for name in DENIED:
            deny(name)
        deny("socket", _ArgCompare(0, _NE, SOCKET_FAMILY, 0))  # on all 64 bits: stray upper bits deny the call
        for name, arguments, _ in DENIED_WITH:
            deny(name, *(_ArgCompare(index, _MASKED_EQ, 0xFFFFFFFF, int(value)) for index, value in arguments.items()))
        program = os.memfd_create("seccomp")
        try:
            result = library.seccomp_export_bpf(context, program)
            if result != 0:
                raise SeccompUnavailable(f"libseccomp could not export the filter: {os.strerror(-result)}.")
            os.lseek(program, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(program, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(program)
    finally:
        library.seccomp_release(context)
