"""What a training run allocates and keeps: memray's record of the allocations made between two steps and still alive
at the second, grouped by where they were made. Prints figures; not a test. Needs memray (`pip install memray`).

It trains `recipes/tool_team.py`'s program (its settings, its episode function, the trainer's own endpoint) or the
quickstart's built-in rollout on a tiny randomly initialised Llama with the embedded model's tokenizer (hidden size
16, 2 layers): what grows from step to step in the machinery (episodes, clients, the server, the rollout, caches) grows
there as on the real model, and a step takes seconds instead of a minute. Tracking starts after step `--start` (what
step 1 allocates once is not growth) and stops after step `--stop`; memray's native stacks name C allocations too.

    python recipes/benchmarks/profile_live_memory.py --recipe tool_team --start 3 --stop 9   # ~4 min on 2 CPU cores

This is how the program path's growth of ~2.6 MiB a step was found (docs/memory.md, "The program path's growth"):
before the fix, 15.9 of the 17.1 MiB still alive after steps 3-9 were TLS contexts, one per episode's client.
"""

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_serve import tiny_base  # noqa: E402
from bench_soak import recipe_trainer  # noqa: E402

from trl_marl.memory.measured import status_bytes  # noqa: E402

# The functions that build a TLS context and load the CA certificates into it: the standard library's, and httpx's
# (`httpcore2.default_ssl_context` on Linux, which calls `load_verify_locations` itself).
TLS_CONTEXT_MAKERS = ("create_default_context", "default_ssl_context", "load_verify_locations")


def where(record) -> str:
    """An allocation's place: "TLS contexts" when OpenSSL made it for a new context, else its 4 innermost Python
    frames (its innermost native frames where no Python frame is known)."""
    try:
        frames = list(record.hybrid_stack_trace(max_stacks=60))
    except AssertionError:  # memray cannot merge some native stacks with their Python frames
        frames = list(record.stack_trace(max_stacks=60))
    if any(function in TLS_CONTEXT_MAKERS for function, _, _ in frames):
        return "TLS contexts (CA certificates parsed into a new ssl.SSLContext)"
    python = [
        f"{function} ({path.rsplit('/', 1)[-1]}:{line})" for function, path, line in frames if path.endswith(".py")
    ]
    return " <- ".join(python[:4] or [function for function, _, _ in frames[:4]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("tool_team", "quickstart"), default="tool_team")
    parser.add_argument("--start", type=int, default=3, help="track from the end of this step")
    parser.add_argument("--stop", type=int, default=9, help="to the end of this one")
    parser.add_argument("--top", type=int, default=12, help="places printed")
    options = parser.parse_args()
    if not 1 <= options.start < options.stop:
        parser.error(f"--start ({options.start}) must be at least 1 and below --stop ({options.stop}).")
    import memray
    from transformers import TrainerCallback

    work = tempfile.mkdtemp(prefix="profile-live-memory-")
    capture = os.path.join(work, "live.bin")
    # quiet, nothing saved; a random model's tool calls are mostly wrong: its episodes still run, call and record,
    # and none may stop the run
    quiet = {"disable_tqdm": True, "save_strategy": "no", "report_to": "none", "episode_max_failed_fraction": 1.0}
    model = tiny_base(os.path.join(work, "tiny"), positions=1024)
    trainer = recipe_trainer(options.recipe, options.stop, work, model, **quiet)
    resident = {}

    class Track(TrainerCallback):
        tracker = None

        def on_step_end(self, args, state, control, **kwargs):
            resident[state.global_step] = status_bytes("VmRSS") / 2**20
            if state.global_step == options.start:
                Track.tracker = memray.Tracker(capture, native_traces=True, trace_python_allocators=True)
                Track.tracker.__enter__()
            elif state.global_step == options.stop:
                Track.tracker.__exit__(None, None, None)

    trainer.add_callback(Track())
    trainer.train()
    size, count = collections.Counter(), collections.Counter()
    for record in memray.FileReader(capture).get_leaked_allocation_records(merge_threads=True):
        place = where(record)
        size[place] += record.size
        count[place] += record.n_allocations
    steps = options.stop - options.start
    print(f"resident set after each step (MiB): {', '.join(f'{k}: {v:.0f}' for k, v in sorted(resident.items()))}")
    alive = sum(size.values()) / 2**20
    print(f"allocated after step {options.start} and alive after step {options.stop}: {alive:.2f} MiB")
    for place, total in size.most_common(options.top):
        print(f"{total / 2**20:8.3f} MiB ({total / steps / 2**20:.3f} a step) in {count[place]:6d} blocks: {place}")


if __name__ == "__main__":
    main()
