"""Removing a local run's files while code that escaped the run may still be changing them (issue 21, weakness 7).

The local backend's child runs as ``nobody`` when the trainer is root and may leave a descendant behind that keeps
renaming things in its scratch directory during cleanup. Cleanup must never follow a symlink it planted, never act by
path where it can write, and never raise into the trainer. The races are reproduced at exact moments by hooking the
``os`` calls of the removal; the last test mounts the real attack end to end.
"""

import errno
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings
from pathlib import Path

import pytest
from sandbox_helpers import sandbox_processes, wait_until_gone

from trl_marl.sandbox import Limits, Sandbox
from trl_marl.sandbox.backends import NOBODY
from trl_marl.sandbox.cleanup import remove_tree


@pytest.fixture
def reachable_tmp():
    """A temporary directory that the sandbox user (nobody, when the tests run as root) can reach."""
    directory = Path(tempfile.mkdtemp(dir="/var/tmp"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def victim(tmp_path):
    """A directory of the trainer's outside the run, holding a file named like one in the run's scratch."""
    directory = tmp_path / "victim"
    directory.mkdir(mode=0o755)
    (directory / "f").write_text("the trainer's data")
    (directory / "f").chmod(0o644)
    return directory


def assert_untouched(victim: Path) -> None:
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755
    assert (victim / "f").read_text() == "the trainer's data"
    assert stat.S_IMODE((victim / "f").stat().st_mode) == 0o644


@pytest.mark.parametrize("moment", ["opened", "emptied"])
def test_a_directory_swapped_for_a_symlink_mid_removal_is_unlinked_never_followed(
    tmp_path, victim, monkeypatch, moment
):
    run = tmp_path / "run"
    swapped = run / "scratch" / "x"
    swapped.mkdir(parents=True)
    for name in ("f", "g"):
        (swapped / name).write_text("child's")
    real_open, real_unlink = os.open, os.unlink
    fired = []

    def swap() -> None:  # what a racing child does: its directory becomes a symlink to the trainer's files
        fired.append(True)
        swapped.rename(run / "scratch" / "moved")
        swapped.symlink_to(victim)

    def hooked_open(path, flags, mode=0o777, *, dir_fd=None):
        if moment == "opened" and path == "x" and dir_fd is not None and not fired:
            swap()  # between learning that x is a directory and opening it
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def hooked_unlink(path, *, dir_fd=None):
        if moment == "emptied" and path == "f" and dir_fd is not None and not fired:
            real_unlink(swapped / "f")  # the child removes the file first: the trainer's unlink fails
            swap()  # while x is being emptied
        return real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", hooked_open)
    monkeypatch.setattr(os, "unlink", hooked_unlink)
    remove_tree(run)
    monkeypatch.undo()
    assert fired and not run.exists()
    assert_untouched(victim)


@pytest.mark.parametrize("user", ["this process", "nobody"])
def test_directories_the_child_made_unreadable_or_read_only_are_removed(reachable_tmp, user):
    if user == "nobody" and os.geteuid() != 0:
        pytest.skip("switching to uid nobody needs root")
    parent = reachable_tmp / "parent"
    run = parent / "run"
    for directory in ("a/b", "c", "d"):
        (run / directory).mkdir(parents=True)
        (run / directory / "f").write_text("x")
    if user == "nobody":
        for path in [parent, *parent.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    (run / "a").chmod(0o000)
    (run / "c").chmod(0o500)
    (run / "d").chmod(0o300)
    if user == "this process":
        remove_tree(run)
    else:  # the non-root path: permissions bind, and only the owner may chmod
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                remove_tree(run)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert not run.exists()


def test_a_removal_that_keeps_failing_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    (run / "scratch").mkdir(parents=True)

    def busy(path, *, dir_fd=None):
        raise OSError(errno.EBUSY, "Device or resource busy", path)

    monkeypatch.setattr(os, "rmdir", busy)
    with caplog.at_level(logging.WARNING):
        remove_tree(run)  # returns after a bounded number of passes
    assert str(run) in caplog.text and "busy" in caplog.text


DEEP_REMOVAL = """
import os, resource, sys
from trl_marl.sandbox.cleanup import remove_tree

run = sys.argv[1]
fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
for _ in range(3000):  # nested deeper than PATH_MAX allows by path: made one level at a time
    os.mkdir("d", dir_fd=fd)
    deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = deeper
os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(remove_tree(run), os.path.exists(run))
"""


@pytest.mark.slow
def test_a_tree_nested_deeper_than_the_open_file_limit_is_removed(tmp_path):
    # One open directory per level would run a trainer with 256 descriptors out of them 256 levels down.
    run = tmp_path / "run"
    run.mkdir()
    try:
        command = [sys.executable, "-c", DEEP_REMOVAL, str(run)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True", "False"], done.stderr[-2000:]
    finally:  # whatever failed, leave no tree that pytest's own (recursive) cleanup of tmp_path would choke on
        subprocess.run(["rm", "-rf", str(run)], check=True)


ESCAPING_SWAPPER = """
import os, time
os.mkdir("x")
for index in range(20000):  # slow to empty: the trainer is still at it when the swap comes
    open(f"x/{{index}}", "w").close()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # escaped the run's session: outlives the run, as nobody
        emptied_since = os.stat("x").st_mtime_ns
        with open({pid_file!r}, "w") as file:
            file.write(str(os.getpid()))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if os.stat("x", follow_symlinks=False).st_mtime_ns != emptied_since:  # the trainer is emptying x
                    os.rename("x", "moved")
                    os.symlink({victim!r}, "x")
                    break
            except OSError:
                break
            time.sleep(0.0005)
        time.sleep(60)
    os._exit(0)
os.wait()
while not os.path.exists({pid_file!r}):
    time.sleep(0.01)
print("escaped")
"""


def test_an_escaped_child_swapping_its_scratch_for_a_symlink_cannot_touch_the_trainers_files(
    shared_tmp, reachable_tmp, victim
):
    if os.geteuid() != 0:
        pytest.skip("the local backend runs code as uid nobody only when the trainer is root")
    reachable_tmp.chmod(0o777)  # where the escaped child tells its pid, to be killed at the end
    pid_file = reachable_tmp / "pid"
    before = sandbox_processes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sandbox = Sandbox("local", limits=Limits(wall_time_s=30))
    source = textwrap.dedent(ESCAPING_SWAPPER).format(pid_file=str(pid_file), victim=str(victim / "f"))
    try:
        result = sandbox.run(source)  # raised NotADirectoryError, having chmodded the victim through the symlink
        assert result.stdout == "escaped\n", result.stderr
        assert_untouched(victim)
        # As root, cleanup takes each directory from nobody before emptying it: the swap fails, the removal does not.
        assert list(shared_tmp.iterdir()) == []
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        time.sleep(0.1)
        assert wait_until_gone(before) == set()
