"""Sandbox throughput: executions per second of one trivial program, three ways. Prints figures; not a test.

Ways: `Sandbox(backend="bubblewrap")`, `Sandbox(backend="local")` and, as the floor, a bare `subprocess.run([python,
"-I", "-S", "-c", SOURCE])` with the interpreter the sandbox uses; also that bare run with a no-op preexec_fn, which
makes Python fork() this process (torch and trl_marl imported, like a trainer) instead of vfork(), as the sandbox must
when the trainer runs as root (it then starts the sandbox as nobody). Each is measured one run at a time
(`Sandbox.run`) and two at once (`run_many` with max_workers=2; bare: a ThreadPoolExecutor of 2), plus `Sandbox.check`
of a 3-test function under bubblewrap. Every run's output is checked. The cases alternate in rounds (the order reversed
every other round) so that all the ratios come from one run under the same machine load.

Usage, from the repository root:
    python recipes/benchmarks/bench_sandbox.py                    # ~75 s on 2 CPU cores
    python recipes/benchmarks/bench_sandbox.py --runs 50 --warmup 5 --rounds 2 --json /tmp/bench_sandbox.json
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trl_marl.sandbox import CallTest, Sandbox, SandboxUnavailable, max_concurrency, probe
from trl_marl.sandbox.backends import sandbox_python, sandbox_user

SOURCE = "print(sum(range(1000)))"
EXPECTED = "499500\n"
FUNCTION = "def add(a, b):\n    return a + b\n"
TESTS = [CallTest((1, 2), 3), CallTest((-5, 5), 0), CallTest((10**12, 1), 10**12 + 1)]
WORKERS = 2
POOL = ThreadPoolExecutor(WORKERS)  # the bare-subprocess concurrent case


def ok(result):
    return result.ok and result.stdout == EXPECTED


def bare_run(python, fork=False):
    """One bare execution. `fork`: a no-op preexec_fn, which makes Python fork() the trainer process instead of using
    vfork(), as it must for the sandbox when the trainer is root (user=)."""
    extra = {"preexec_fn": lambda: None} if fork else {}

    def run(_):
        argv = [python, "-I", "-S", "-c", SOURCE]
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, **extra)
        return done.returncode == 0 and done.stdout == EXPECTED

    return run


def cases(python, sandboxes):
    """name -> (backend, mode, function(n) running n executions and returning how many were right)."""
    table = {}
    for name, bare in (("bare", bare_run(python)), ("forked", bare_run(python, fork=True))):
        way = "bare subprocess" + ", fork()" * (name == "forked")
        table[f"{name} sequential"] = (way, "sequential", lambda n, b=bare: sum(b(i) for i in range(n)))
        table[f"{name} concurrent"] = (way, "concurrent", lambda n, b=bare: sum(POOL.map(b, range(n))))
    request = (FUNCTION, "add", TESTS)
    for name, sandbox in sandboxes.items():
        table[f"{name} sequential"] = (
            name,
            "sequential",
            lambda n, s=sandbox: sum(ok(s.run(SOURCE)) for _ in range(n)),
        )
        table[f"{name} concurrent"] = (name, "concurrent", lambda n, s=sandbox: sum(map(ok, s.run_many([SOURCE] * n))))
        if name == "bubblewrap":
            table["check sequential"] = (
                "bubblewrap check (3 tests)",
                "sequential",
                lambda n, s=sandbox: sum(s.check(*request) == 1.0 for _ in range(n)),
            )
            table["check concurrent"] = (
                "bubblewrap check (3 tests)",
                "concurrent",
                lambda n, s=sandbox: sum(rate == 1.0 for rate in s.check_many([request] * n)),
            )
    return table


def machine(python):
    try:
        bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        bwrap = "not installed"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    sandbox_version = subprocess.run([python, "-I", "-S", "-c", "import platform; print(platform.python_version())"],
                                     capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "platform": platform.platform(),
        "cpus": cpus,
        "python": platform.python_version(),
        "sandbox_python": f"{python} ({sandbox_version})",
        "sandbox_user": "nobody (trainer is root)" if sandbox_user() is not None else "this user",
        "bwrap": bwrap,
        "max_concurrency": max_concurrency(),
        "trainer_rss_mib": int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) // 1024,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="timed executions per case (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed executions per case first (default 10)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds the runs are split into (default 4)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = parser.parse_args()

    python = sandbox_python(sandbox_user())
    sandboxes = {}
    capability = probe()
    print(f"probe: {capability.reason}")
    for name in ("bubblewrap", "local"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # local: "not a security boundary"
                sandboxes[name] = Sandbox(backend=name, max_workers=WORKERS)
        except SandboxUnavailable as error:
            print(f"skipping {name}: {error}")
    table = cases(python, sandboxes)
    for _, _, function in table.values():
        function(args.warmup)

    seconds, done, right = dict.fromkeys(table, 0.0), dict.fromkeys(table, 0), dict.fromkeys(table, 0)
    order = list(table)
    for round_index in range(args.rounds):
        n = args.runs // args.rounds + (round_index < args.runs % args.rounds)
        for name in order if round_index % 2 == 0 else reversed(order):
            start = time.perf_counter()
            right[name] += table[name][2](n)
            seconds[name] += time.perf_counter() - start
            done[name] += n
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    for sandbox in sandboxes.values():
        sandbox.close()

    info = machine(python)
    results = []
    for name, (backend, mode, _) in table.items():
        ms = 1000 * seconds[name] / done[name]
        bare_ms = 1000 * seconds[f"bare {mode}"] / done[f"bare {mode}"]
        results.append(
            dict(way=backend, mode=mode, runs=done[name], correct=right[name], seconds=round(seconds[name], 3),
                 runs_per_s=round(1000 / ms, 2), ms_per_run=round(ms, 2), vs_bare=round(ms / bare_ms, 2))
        )  # fmt: skip

    print("\ncommand: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print("machine: " + ", ".join(f"{key}={value}" for key, value in info.items()))
    print(f"program: {SOURCE!r}; concurrent = {WORKERS} at once; ms/run = wall time / runs; x bare = ms/run / bare's")
    print(f"\n{'way':<28} {'mode':<11} {'runs':>5} {'ok':>5} {'runs/s':>8} {'ms/run':>8} {'x bare':>7}")
    for row in results:
        print(f"{row['way']:<28} {row['mode']:<11} {row['runs']:>5} {row['correct']:>5} {row['runs_per_s']:>8.1f} "
              f"{row['ms_per_run']:>8.2f} {row['vs_bare']:>6.2f}x")  # fmt: skip
    if any(row["correct"] != row["runs"] for row in results):
        print("\nWARNING: some executions did not give the expected output (see the ok column).")
    if args.json:
        summary = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": info,
            "probe": capability.reason,
            "settings": {"runs": args.runs, "warmup": args.warmup, "rounds": args.rounds, "workers": WORKERS},
            "results": results,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
