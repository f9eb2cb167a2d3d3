"""Remove a local run's directory while code that escaped the run may still be changing it.

The local backend's child, or a descendant that left its session and still runs, can rename anything in its scratch
directory at any moment: a directory can become a symlink to a file of the trainer's between two steps of the
removal. So every step acts on an open directory by a single name (``dir_fd=``), and a directory is only ever opened
with ``O_NOFOLLOW``: a symlink is unlinked itself, never followed, and a swap between two steps makes a step fail,
never act elsewhere. Nothing is done by path below the run directory.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat

logger = logging.getLogger(__name__)

# Passes over the tree: a pass that met a swap starts again from the top, which sees the tree as it now is. Bounded:
# cleanup never loops forever on a child that keeps changing its files.
_PASSES = 5
# Directories held open at once. A directory deeper than this is moved up into the top one and removed from there, so
# a child that nested thousands cannot exhaust the trainer's file descriptors.
_MAX_OPEN = 32
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike) -> bool:
    """Remove the directory ``path`` and everything in it; whether it is gone. Never raises: a failure is logged.

    Only ``path``'s parent is looked up by path: the trainer made ``path`` there, where the sandbox cannot write. A
    directory the child made unreadable or read-only (chmod 000) is removed too, as root or not.
    """
    parent, name = os.path.split(os.path.abspath(path))
    failure: OSError | None = None
    for _ in range(_PASSES):
        try:
            parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            failure = error
            break
        try:
            _remove_entry(parent_fd, name)
            return True
        except OSError as error:
            failure = error
        finally:
            os.close(parent_fd)
    logger.warning("Could not remove the sandbox's run directory %s: %s", path, failure)
    return False


def _remove_entry(parent_fd: int, name: str) -> None:
    """Remove the entry ``name`` of the open directory ``parent_fd``; a directory with everything in it, depth first.

    Iterative, one open directory per level down to `_MAX_OPEN` levels: a deep tree costs neither Python stack nor more
    file descriptors.
    """
    opened = _unlink_or_open(parent_fd, name)
    if opened is None:
        return
    stack = [(parent_fd, name, *opened)]  # per level: the directory above, the name in it, the open fd, names left
    try:
        while stack:
            above_fd, directory, fd, names = stack[-1]
            if names:
                child = names.pop()
                if len(stack) >= _MAX_OPEN:
                    _unlink_or_move(fd, child, top_fd=stack[0][2], top_names=stack[0][3])
                    continue
                opened = _unlink_or_open(fd, child)
                if opened is not None:
                    stack.append((fd, child, *opened))
                continue
            stack.pop()
            os.close(fd)
            try:
                # Fails (ENOTEMPTY, ENOTDIR) if the child added to the directory or swapped its name meanwhile
                # (never as root: see `_claim`); the next pass sees the tree as it is then.
                os.rmdir(directory, dir_fd=above_fd)
            except FileNotFoundError:
                pass
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)


def _unlink_or_move(dir_fd: int, name: str, top_fd: int, top_names: list[str]) -> None:
    """Unlink the entry ``name`` of ``dir_fd``, or, for a directory, move it into ``top_fd`` to be removed from there
    (its new name joins ``top_names``)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    moved = f".trl-marl-deep-{next(_MOVED)}"
    try:
        os.rename(name, moved, src_dir_fd=dir_fd, dst_dir_fd=top_fd)
    except FileNotFoundError:
        return
    top_names.append(moved)


_MOVED = itertools.count()


def _unlink_or_open(dir_fd: int, name: str) -> tuple[int, list[str]] | None:
    """Unlink the entry ``name`` of ``dir_fd`` (a symlink itself, never its target), or, for a directory, open it:
    its fd and the names in it. None when the entry is gone."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return None
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        pass
    try:
        fd = _open_directory(dir_fd, name)
    except FileNotFoundError:
        return None
    try:
        _claim(fd)
        with os.scandir(fd) as entries:
            return fd, [entry.name for entry in entries]
    except BaseException:
        os.close(fd)
        raise


def _open_directory(dir_fd: int, name: str) -> int:
    """Open the directory ``name`` of ``dir_fd`` for reading, never through a symlink (ELOOP, ENOTDIR instead)."""
    try:
        return os.open(name, _OPEN_DIRECTORY, dir_fd=dir_fd)
    except PermissionError:  # chmod 000 by the child, and this process is not root
        pass
    # A handle on the directory itself, made readable through /proc/self/fd (fchmod refuses an O_PATH handle): that
    # names the inode that was opened, not a path the child can swap.
    handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(handle)


def _claim(fd: int) -> None:
    """Make the open directory ``fd`` the trainer's to empty before it is listed.

    As root, root's alone: the sandbox user (nobody) can then add, rename or remove nothing in it, so a child that
    escaped its run cannot race the removal at all. Otherwise (the sandbox runs as the trainer's own user), writable
    and searchable by its owner.
    """
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o700)
    elif stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
