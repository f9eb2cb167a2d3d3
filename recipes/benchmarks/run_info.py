"""What every benchmark's JSON summary starts with: the command that made it, when, and on what machine."""

import datetime
import os
import platform
import sys
from pathlib import Path


def run_header(**machine) -> dict:
    """`command`, `date` and `machine` (platform, usable CPUs, Python, then the caller's own `machine` facts)."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python": platform.python_version(),
            **machine,
        },
    }
