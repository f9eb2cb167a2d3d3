"""What the built-in tasks that run model-written code share: the process-wide sandbox, the code in a completion, and a
cache of what sandbox runs gave."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

from ..sandbox import ExecutionResult, Sandbox, Status

Value = TypeVar("Value")

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()


def shared_sandbox() -> Sandbox:
    """The process-wide sandbox of the built-in rewards (bubblewrap unless TRL_MARL_SANDBOX=local), made on first use;
    raises SandboxUnavailable when the machine cannot isolate code."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = Sandbox()
        return _sandbox


def extract_code(text: str) -> str:
    """The Python code in a completion: its fenced code blocks joined in order, or the whole text when it has none."""
    blocks = _FENCE.findall(text)
    return "\n\n".join(block.strip("\n") for block in blocks) if blocks else text


class SandboxResultCache:
    """What sandbox runs gave, by key: a bounded (least recently used out first), thread-safe cache. A task's rewards,
    its transition and `success` ask the same questions about the same programs; one run answers them all."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._values: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_run(self, key: Hashable, run: Callable[[], tuple[Value, ExecutionResult]]) -> Value:
        """The value remembered for `key`; else `run()`'s `(value, the sandbox result it was read from)`, remembered
        unless the sandbox refused the run (nothing ran, so a later call may run it)."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value, result = run()
        if result.status is not Status.REFUSED:
            with self._lock:
                self._values[key] = value
                if len(self._values) > self.size:
                    self._values.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        return len(self._values)
