"""The code that runs *inside* the sandbox, and the plain-value format it shares with the trusted parent.

This file is copied into every sandbox and started as ``python -s -S -B harness.py job``; it imports only the
standard library. It sets the resource limits, then runs the candidate either as a program (``mode="program"``: the
source runs as ``__main__``) or as a function under test (``mode="calls"``: the source is executed, the entry point is
called on each input, and every return value is printed as plain JSON).

Nothing this harness prints is trusted. The candidate runs in the same interpreter and can patch, skip or imitate any
of it; that is fine, because the expected values never enter the sandbox. The parent decodes the output with
[`decode_plain`], which accepts only the tagged plain types below, and compares with exact, type-checked equality.

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
_TAGS = ("float", "tuple", "dict", "set", "frozenset", "bytes")


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
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is str:
        return data
    if kind is float:
        if not math.isfinite(data):
            raise ValueError("a non-finite float must be tagged")
        return data
    if kind is list:
        return [decode_plain(item) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"not a plain value: {str(data)[:80]!r}")
    ((tag, payload),) = data.items()
    if tag == "float" and payload in ("nan", "inf", "-inf"):
        return float(payload)
    if tag == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    if tag not in _TAGS or type(payload) is not list:
        raise ValueError(f"unknown plain-value tag {tag!r}")
    items = [decode_plain(item) for item in payload]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in items):
        return {key: item for key, item in items}
    raise ValueError(f"malformed {tag!r} payload")


def _die_with_parent(parent_pid):
    """Local mode (no pid namespace): have the kernel SIGKILL this process when the trainer dies."""
    import ctypes

    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != parent_pid:  # the trainer died before the request took effect
        os._exit(1)


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
    if "parent_pid" in job:
        _die_with_parent(job["parent_pid"])
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
