"""The code that runs *inside* the sandbox, and the plain-value format it shares with the trusted parent.

This file is copied into every sandbox and started as ``python -s -S -B harness.py job``; it imports only the
standard library. It sets the resource limits, then runs the candidate either as a program (``mode="program"``: the
source runs as ``__main__``) or as a function under test (``mode="calls"``: the source is executed, the entry point is
called on each input, and every return value is printed as plain JSON).

Nothing this harness prints is trusted. The candidate runs in the same interpreter and can patch, skip or imitate any
of it; that is fine, because the expected values never enter the sandbox. The parent decodes the output with a
bounded [`PlainDecoder`], which accepts only the tagged plain types below, and compares with exact, type-checked
equality.

Plain values: ``None``, ``bool``, ``int``, ``str`` and finite ``float`` as themselves; ``list`` as a JSON array; other
types as a one-key object: ``{"float": "nan"}``, ``{"tuple": [...]}``, ``{"dict": [[k, v], ...]}``, ``{"set": [...]}``,
``{"frozenset": [...]}``, ``{"bytes": "<hex>"}``. Exact types only: a subclass of ``int`` or ``list`` (for instance an
object whose ``__eq__`` always returns True) is not plain and is reported as an error.
"""

import marshal
import math
import os
import sys

JOB_FORMAT = 4  # marshal version of the job file: plain dicts, lists, strings and numbers, readable by Python >= 3.4
MEMORY_EXIT_CODE = 86  # the harness's exit status when the candidate ran out of memory (see Limits.memory_bytes)
SETUP_EXIT_CODE = 87  # the harness's exit status when it could not set the sandbox up; nothing of the candidate ran
_CONTAINER_TAGS = ("tuple", "dict", "set", "frozenset")


def encode_plain(value):
    """Python value → JSON-ready plain value. Raises TypeError for anything that is not exactly a plain type."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode_plain(item) for item in value]
    if kind is tuple:
        return {"tuple": [encode_plain(item) for item in value]}
    if kind is dict:
        return {"dict": [[encode_plain(key), encode_plain(item)] for key, item in value.items()]}
    if kind is set or kind is frozenset:
        return {kind.__name__: [encode_plain(item) for item in value]}
    if kind is bytes:
        return {"bytes": value.hex()}
    raise TypeError(f"a value of type {kind.__name__!r} is not a plain value")


def decode_plain(data):
    """JSON-parsed plain value → Python value. Raises ValueError on anything [`encode_plain`] cannot have produced."""
    return PlainDecoder().decode(data)


class PlainBoundError(ValueError):
    """A plain value over a bound of [`PlainDecoder`] or [`HashCheck`]."""


class PlainDecoder:
    """Decodes plain values, under bounds when they are untrusted (None: no bound). A value over a bound raises
    `PlainBoundError` before it is built, so that decoding stays linear in the size of the input:

    - ``max_depth``: containers nested at most this deep (64 nested lists are 64 levels);
    - ``max_values``: values in all, containers and scalars, over every `decode` of this decoder;
    - ``max_shared_hash``: set elements or dict keys with one hash, see [`HashCheck`].
    """

    def __init__(self, max_depth=None, max_values=None, max_shared_hash=None):
        self.max_depth = max_depth
        self.max_values = max_values
        self.values = 0
        self.hashes = HashCheck(max_shared_hash) if max_shared_hash is not None else None

    def decode(self, data, depth=0):
        """JSON-parsed plain value → Python value. Raises ValueError on anything [`encode_plain`] cannot have
        produced, PlainBoundError (a ValueError) on a value over a bound."""
        self.values += 1
        if self.max_values is not None and self.values > self.max_values:
            raise PlainBoundError(f"more than {self.max_values} values")
        kind = type(data)
        if data is None or kind is bool or kind is int or kind is str:
            return data
        if kind is float:
            if not math.isfinite(data):
                raise ValueError("a non-finite float must be tagged")
            return data
        if kind is dict and len(data) == 1:
            ((tag, payload),) = data.items()
            if tag == "float" and payload in ("nan", "inf", "-inf"):
                return float(payload)
            if tag == "bytes" and type(payload) is str:
                return bytes.fromhex(payload)
            if tag not in _CONTAINER_TAGS or type(payload) is not list:
                raise ValueError(f"not a plain value: {str(data)[:80]!r}")
        elif kind is not list:
            raise ValueError(f"not a plain value: {str(data)[:80]!r}")
        if self.max_depth is not None and depth >= self.max_depth:
            raise PlainBoundError(f"nested deeper than {self.max_depth} levels")
        if kind is list:
            return [self.decode(item, depth + 1) for item in data]
        if tag == "tuple":
            return tuple([self.decode(item, depth + 1) for item in payload])
        if tag == "dict" and not all(type(pair) is list and len(pair) == 2 for pair in payload):
            raise ValueError("malformed 'dict' payload")
        keys, values, nested = [], [], set()
        for item in payload:
            colliding = self.hashes.colliding if self.hashes is not None else 0
            keys.append(self.decode(item[0] if tag == "dict" else item, depth + 1))
            if self.hashes is not None and self.hashes.colliding > colliding:
                nested.add(len(keys) - 1)
            if tag == "dict":
                values.append(self.decode(item[1], depth + 1))
        if self.hashes is not None:
            self.hashes.check(keys, nested)
        if tag == "dict":
            return dict(zip(keys, values))
        return set(keys) if tag == "set" else frozenset(keys)


class HashCheck:
    """Refuses the keys of a set or dict (its elements, or its keys) before they are hashed into it, when building it
    could go quadratic: more than ``max_shared_hash`` keys with one hash (each is compared with the others), or keys
    that share a hash and hold a set whose own elements share a hash (comparing two such keys looks each element up
    among several candidates, and nesting would multiply those). Honest values seldom share a hash (-1 and -2 do)."""

    def __init__(self, max_shared_hash):
        self.max_shared_hash = max_shared_hash
        self.colliding = 0  # key lists checked so far in which some keys share a hash

    def check(self, keys, nested):
        """Raises PlainBoundError when ``keys`` are over the bound; ``nested``: the indices of the keys that hold a
        checked set whose keys share a hash. TypeError for an unhashable key."""
        hashes = list(map(hash, keys))
        if len(set(hashes)) == len(hashes):
            return
        counts = {}
        for code in hashes:
            counts[code] = counts.get(code, 0) + 1
        if max(counts.values()) > self.max_shared_hash:
            raise PlainBoundError(f"more than {self.max_shared_hash} set elements or dict keys share a hash")
        if any(counts[code] > 1 and index in nested for index, code in enumerate(hashes)):
            raise PlainBoundError("set elements or dict keys that share a hash hold sets whose elements share one")
        self.colliding += 1


def _die_with_trainer(job):
    """Have the kernel SIGKILL this process when its parent dies, then exit now if the trainer already has.

    Local mode (no pid namespace): the parent is the trainer, checked by pid. Bubblewrap: the parent is bubblewrap,
    which arms the same signal only just before it starts the harness, so a trainer killed during those milliseconds
    of setup would leave the harness running, orphaned and without a deadline; the trainer holds the only write end of
    the ``lifeline`` pipe, and end of file there means it is gone (and bubblewrap, which dies with it)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if "parent_pid" in job and os.getppid() != job["parent_pid"]:
        os._exit(1)
    if "lifeline" in job:
        import select

        if select.select([job["lifeline"]], [], [], 0)[0] and not os.read(job["lifeline"], 1):
            os._exit(1)
        os.close(job["lifeline"])


def _mount_tmpfs(mounts):
    """Bubblewrap: mount each writable tmpfs afresh with its size and inode caps (bubblewrap's ``--tmpfs`` takes no
    inode cap), in a mount namespace of the sandbox's own, then drop every capability from every set, the bounding set
    included (``CAP_SYS_ADMIN`` for these mounts and ``CAP_SETPCAP`` for that drop are all bubblewrap granted): the
    candidate starts with none and cannot regain any."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, what):
        if result != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"{what}: {os.strerror(number)}")

    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    for path, size, inodes in mounts:
        options = f"size={size},nr_inodes={inodes},mode=0755".encode()
        check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", 2 | 4, options), f"mount {path}")  # MS_NOSUID | MS_NODEV
    os.chdir(os.getcwd())  # the same path now names the new mount

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Sets(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    for capability in range(64):  # PR_CAPBSET_DROP, up to the first number this kernel does not know
        if libc.prctl(24, capability, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
            break
    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Sets * 2)()), "capset")  # version 3: all sets empty
    with open("/proc/self/status") as status:
        held = [line.strip() for line in status if line.startswith(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))]
    held = [line for line in held if line.split(":")[1].strip("0\t ")]
    if held:
        raise OSError(f"capabilities left after dropping them: {', '.join(held)}")


def _set_limits(rlimits):
    import resource

    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _run_program(source):
    sys.argv = ["main.py"]
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def _run_calls(source, entry_point, calls):
    # The results go to the original stdout; whatever the candidate prints lands on stderr instead.
    results_fd = os.dup(1)
    os.dup2(2, 1)
    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    exec(compile(source, "solution.py", "exec"), namespace)
    function = namespace.get(entry_point)
    results = []
    for encoded_args in calls:
        try:
            if not callable(function):
                raise NameError(f"{entry_point!r} is not defined as a function")
            results.append({"value": encode_plain(function(*decode_plain(encoded_args)))})
        except Exception as error:  # one failing call fails only that test
            results.append({"error": f"{type(error).__name__}: {str(error)[:200]}"})
    import json  # only here: importing it costs a program run ~10 ms

    payload = json.dumps({"results": results}).encode()
    while payload:
        payload = payload[os.write(results_fd, payload) :]


def main(job_path):
    del sys.path[0]  # this file's directory: nothing there for the candidate to import
    with open(job_path, "rb") as handle:
        job = marshal.load(handle)  # written by the trainer, not by the candidate
    _die_with_trainer(job)
    if "mounts" in job:
        try:
            _mount_tmpfs(job["mounts"])
        except OSError as error:
            os.write(2, f"sandbox setup failed: {error}\n".encode())
            os._exit(SETUP_EXIT_CODE)
    _set_limits(job["rlimits"])
    try:
        if job["mode"] == "program":
            _run_program(job["source"])
        else:
            _run_calls(job["source"], job["entry_point"], job["calls"])
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(MEMORY_EXIT_CODE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the candidate's atexit hooks


if __name__ == "__main__":
    main(sys.argv[1])
