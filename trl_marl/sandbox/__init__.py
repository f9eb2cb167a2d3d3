"""Run model-written code in isolation, under hard limits, and score it from its plain outputs only.

See docs/sandbox.md for the threat model and what each backend guarantees.

May import: nothing of trl_marl but itself (it sits just above the foundation modules, and needs none of them).
"""

from .backends import SandboxUnavailable
from .capability import Capability, probe
from .executor import CallTest, Sandbox, max_concurrency
from .process import kill_all
from .result import CallOutput, ExecutionResult, Limits, Status
from .scoring import pass_rate, passed_calls, stdout_matches, strict_equal

__all__ = [
    "CallOutput",
    "CallTest",
    "Capability",
    "ExecutionResult",
    "Limits",
    "Sandbox",
    "SandboxUnavailable",
    "Status",
    "kill_all",
    "max_concurrency",
    "pass_rate",
    "passed_calls",
    "probe",
    "stdout_matches",
    "strict_equal",
]
