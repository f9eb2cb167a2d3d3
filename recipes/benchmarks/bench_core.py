"""Core benchmarks of trl_marl on the embedded default model (SmolLM2-135M-Instruct). Prints figures; not a test.

1. step:     seconds per optimizer step of `MAGRPOTrainer` with one agent vs TRL's `GRPOTrainer` + the same LoRA.
             Both get the same seed, data, LoRA config, G and max_completion_length, and `_generate_single_turn` is
             replaced on both instances by the same deterministic token lists (fixed length, ending in eos): generation
             is excluded by construction and both train on identical tokens. A step is the wall time between
             consecutive `on_step_end` callbacks (rollout scoring, forward, backward, optimizer step, logging); TRL's
             own `step_time` (`training_step` only) is shown too. Runs alternate TRL, MAGRPO, TRL, ... to cancel drift.
2. generate: tokens/s of ONE `generate` call for the whole team (rows routed to their agent's adapter) vs one call
             per agent (`set_adapter`), N = 2 and 4 agents with randomised LoRA B (so the adapters differ), the same
             prompts for every agent, and every completion forced to exactly T new tokens (min = max = T). Also the
             same rows in one call on a single adapter: the bound routing can approach (the cost of batching itself).
3. memory:   peak memory of training steps (fixed completions) with 4 agents vs 1 agent on a 4-bit NF4 base, each
             in its own subprocess: `torch.cuda.max_memory_allocated()` on CUDA, else peak RSS (VmHWM) net of the RSS
             after imports. The peak is taken while loading, then reset and taken while training; the target ratio
             uses the process peak (the larger of the two), the training peak's ratio is shown too.

Usage, from the repository root:
    HF_HUB_OFFLINE=1 PYTHONPATH=. python recipes/benchmarks/bench_core.py --quick   # check the script (~2-3 min)
    HF_HUB_OFFLINE=1 PYTHONPATH=. python recipes/benchmarks/bench_core.py           # figures (~10 min, 2 CPU cores)
    ... [--only {step,generate,memory}] [--output PATH]   # default results/bench_core[_quick].json
"""

import argparse
import contextlib
import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import trl_marl  # noqa: F401 (first: it filters a bitsandbytes notice that importing PEFT would print)

# isort: split
import peft
import torch
import transformers
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import BitsAndBytesConfig, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_info import run_header  # noqa: E402


def rss_kib(field="VmHWM"):
    """This process's peak ("VmHWM") or current ("VmRSS") resident set size in KiB.

    Not `ru_maxrss` on Linux: it survives `exec`, so a subprocess would report its parent's peak if that is higher.
    """
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))
    except OSError:  # no /proc: not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


RSS_AFTER_IMPORTS_KIB = rss_kib("VmRSS")  # after importing torch, transformers, trl, peft and trl_marl

warnings.filterwarnings("ignore", category=FutureWarning)
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ON_CUDA = torch.cuda.is_available()
SEED, G = 42, 4  # G: completions per prompt (num_generations)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
PROMPTS = [
    "Name a colour.", "Name a fruit.", "Count to five.", "Say hello in French.", "What is 2 + 3?",
    "Name a planet.", "Write a haiku about rain.", "Give a synonym of 'fast'.", "Name a prime number.",
    "What is the capital of Italy?", "Describe a cat in one sentence.", "Name a programming language.",
    "Spell 'cat' backwards.", "What day follows Monday?", "Name an ocean.", "Give an antonym of 'hot'.",
]  # fmt: skip
# batch: per_device_train_batch_size (prompt copies per micro-batch); length: completion tokens.
SETTINGS = {
    "quick": dict(
        step_batch=4, step_length=16, step_warmup=1, step_steps=2, step_rounds=2,
        gen_agents=(2, 4), gen_prompts=2, gen_tokens=8, gen_reps=1,
        mem_batch=2, mem_generations=2, mem_length=8, mem_steps=1,
    ),
    "full": dict(
        step_batch=8, step_length=32, step_warmup=1, step_steps=4, step_rounds=3,
        gen_agents=(2, 4), gen_prompts=4, gen_tokens=32, gen_reps=2,
        mem_batch=4, mem_generations=4, mem_length=16, mem_steps=2,
    ),
}  # fmt: skip
TARGETS = {"step": ("<=", 1.10), "generate_2": (">=", 1.5), "generate_4": (">=", 2.5), "memory": ("<=", 1.15)}


def dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})


def train_args(output_dir, batch, length, generations=G, **extra):
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        num_generations=generations,
        max_completion_length=length,
        learning_rate=1e-5,
        seed=SEED,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not ON_CUDA,
        bf16=ON_CUDA,  # TRL's default bf16=True means slow bf16 autocast on most CPUs
        **extra,
    )


def grpo_reward(prompts, completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def team_reward(prompts, completions, **kwargs):
    return [float(sum(len(text) for text in joint.values())) for joint in completions]


# ---------------------------------------------------------------------------------------------------- 1. step time


def fixed_completions(prompt_ids, length, eos_id):
    """Deterministic token lists of `length` tokens ending in eos: both trainers train on exactly these."""
    return [
        [(sum(ids) + 7 * i + k) % 4000 + 100 for k in range(length - 1)] + [eos_id] for i, ids in enumerate(prompt_ids)
    ]


class StepEndTimes(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def step_trainer(kind, model_path, s, output_dir):
    args = train_args(output_dir, s["step_batch"], s["step_length"], max_steps=s["step_warmup"] + s["step_steps"])
    if kind == "TRL":
        trainer = GRPOTrainer(
            model_path, grpo_reward, args=GRPOConfig(**args), train_dataset=dataset(), peft_config=LoraConfig(**LORA)
        )
    else:
        config = MAGRPOConfig(agents=["solo"], **args)
        trainer = MAGRPOTrainer(
            model_path, team_reward, args=config, train_dataset=dataset(), peft_config=LoraConfig(**LORA)
        )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts
    eos_id, length = trainer.processing_class.eos_token_id, s["step_length"]
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (fixed_completions(prompt_ids, length, eos_id), None)
    return trainer


def bench_step(model_path, s):
    loop, inner = {"TRL": [], "MAGRPO": []}, {"TRL": [], "MAGRPO": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {kind: step_trainer(kind, model_path, s, f"{tmp}/{kind}") for kind in loop}
        for round_ in range(s["step_rounds"]):
            for kind, trainer in trainers.items():  # TRL, MAGRPO, TRL, MAGRPO, ...
                timer = StepEndTimes()
                trainer.add_callback(timer)
                trainer.train()  # each round: a fresh optimizer and state, warm-up steps dropped
                trainer.remove_callback(timer)
                times = [b - a for a, b in zip(timer.times, timer.times[1:])][s["step_warmup"] - 1 :]
                step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
                loop[kind] += times
                inner[kind] += step_times[s["step_warmup"] :]
                print(f"  round {round_ + 1} {kind:>6}: " + " ".join(f"{t:.2f}" for t in times) + " s/step")
    mean = {kind: statistics.mean(v) for kind, v in loop.items()}
    median = {kind: statistics.median(v) for kind, v in loop.items()}
    inner_mean = {kind: statistics.mean(v) for kind, v in inner.items()}
    rows = [
        ("step: TRL GRPOTrainer + LoRA, mean s/step", mean["TRL"], None),
        ("step: MAGRPOTrainer 1 agent, mean s/step", mean["MAGRPO"], None),
        ("step: ratio MAGRPO/TRL (means)", mean["MAGRPO"] / mean["TRL"], "step"),
        ("step: ratio MAGRPO/TRL (medians)", median["MAGRPO"] / median["TRL"], None),
        ("step: ratio of TRL's step_time (training_step only)", inner_mean["MAGRPO"] / inner_mean["TRL"], None),
    ]
    held = (
        f"seed {SEED}, {len(PROMPTS)} prompts, LoRA {LORA}, G={G}, per_device_train_batch_size={s['step_batch']}, "
        f"fixed completions of {s['step_length']} tokens, {s['step_warmup']} warm-up + {s['step_steps']} timed "
        f"steps x {s['step_rounds']} alternated rounds"
    )
    return rows, held


# ---------------------------------------------------------------------------------------------- 2. team generation


def bench_generate(model_path, s, num_agents):
    names = [f"agent{i}" for i in range(num_agents)]
    tokens = s["gen_tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        config = MAGRPOConfig(
            agents=names, **train_args(tmp, G, tokens, lora_r=LORA["r"], generation_kwargs={"min_new_tokens": tokens})
        )
        trainer = MAGRPOTrainer(model_path, team_reward, args=config, train_dataset=dataset())
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # fresh LoRA B is zero: every agent would be the base model
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS[: s["gen_prompts"]]]

    def routed():  # the trainer's team call: row r * N + a is agent a's answer to prompt r
        agent_index = list(range(num_agents)) * len(prompts)
        return trainer.team_generation.generate([p for p in prompts for _ in names], agent_index, G)[1]

    def per_agent():  # one call per agent
        trainer.router.route(None)
        completion_ids = []
        for name in names:
            trainer.model.set_adapter(name)
            completion_ids += trainer._generate(prompts)[1]
        return completion_ids

    def one_adapter():  # the same rows in one call on a single adapter: what routing can at best approach
        trainer.router.route(None)
        trainer.model.set_adapter(names[0])
        return trainer._generate([p for p in prompts for _ in names])[1]

    def one_agent_routed():  # an AT-GRPO call: every row is the first agent's (the router's one-adapter path)
        rows = [p for p in prompts for _ in names]
        return trainer.team_generation.generate(rows, [0] * len(rows), G)[1]

    def one_agent_concatenated():  # the same call made to pay every agent's projection and the mask, as before
        route = trainer.router.route

        def mixed_path(row_adapters):
            route(row_adapters)
            trainer.router._single = None

        trainer.router.route = mixed_path
        try:
            return one_agent_routed()
        finally:
            trainer.router.route = route

    modes = (
        ("routed", routed),
        ("per_agent", per_agent),
        ("one_adapter", one_adapter),
        ("one_agent_routed", one_agent_routed),
        ("one_agent_concatenated", one_agent_concatenated),
    )
    totals = {mode: [0, 0.0] for mode, _ in modes}  # tokens, seconds
    for rep in range(s["gen_reps"] + 1):  # rep 0 is a warm-up
        for mode, generate in modes:
            start = time.perf_counter()
            completion_ids = generate()
            elapsed = time.perf_counter() - start
            assert all(len(ids) == tokens for ids in completion_ids), "every completion must have exactly T tokens"
            if rep > 0:
                totals[mode][0] += sum(len(ids) for ids in completion_ids)
                totals[mode][1] += elapsed
    speed = {mode: n / t for mode, (n, t) in totals.items()}
    print(
        f"  {num_agents} agents: routed {speed['routed']:.1f} tok/s, per agent {speed['per_agent']:.1f} tok/s, "
        f"same rows on one adapter {speed['one_adapter']:.1f} tok/s; one agent's rows routed "
        f"{speed['one_agent_routed']:.1f} tok/s, through the concatenated path {speed['one_agent_concatenated']:.1f}"
    )
    return [
        (f"generate {num_agents} agents: same rows on one adapter, tok/s", speed["one_adapter"], None),
        (f"generate {num_agents} agents: routed / one adapter", speed["routed"] / speed["one_adapter"], None),
        (f"generate {num_agents} agents: one routed call, tok/s", speed["routed"], None),
        (f"generate {num_agents} agents: one call per agent, tok/s", speed["per_agent"], None),
        (f"generate {num_agents} agents: speed-up", speed["routed"] / speed["per_agent"], f"generate_{num_agents}"),
        (f"generate one agent's rows of {num_agents}: routed, tok/s", speed["one_agent_routed"], None),
        (
            f"generate one agent's rows of {num_agents}: routed / concatenated path",
            speed["one_agent_routed"] / speed["one_agent_concatenated"],
            None,
        ),
    ]


# --------------------------------------------------------------------------------------------------- 3. peak memory


MEMORY_LORAS = {  # the default adapters, and small ones on the attention projections only
    "r16-all-linear": dict(lora_r=16, lora_alpha=32, lora_target_modules=["all-linear"]),
    "r8-q,v": dict(lora_r=8, lora_alpha=16, lora_target_modules=["q_proj", "v_proj"]),
}


def memory_worker(num_agents, batch, lora, s):
    """Runs in its own process: training steps of `num_agents` agents on a 4-bit NF4 base; prints one JSON line.

    Completions are fixed token lists, as in the step benchmark: 4-bit generation is very slow on CPU, and at these
    lengths its memory (KV cache, last-token logits) is far below that of the training forward and backward.
    """
    names = [f"agent{i}" for i in range(num_agents)]
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16 if ON_CUDA else torch.float32,
    )
    length = s["mem_length"]
    with tempfile.TemporaryDirectory() as tmp:
        args = train_args(tmp, batch, length, s["mem_generations"], max_steps=s["mem_steps"])
        config = MAGRPOConfig(agents=names, **MEMORY_LORAS[lora], **args)
        trainer = MAGRPOTrainer(
            default_model_path(), team_reward, args=config, train_dataset=dataset(), quantization_config=quantization
        )
        trainer.remove_callback(PrinterCallback)
        eos_id = trainer.processing_class.eos_token_id
        trainer._generate_single_turn = lambda ids, *a, **k: (fixed_completions(ids, length, eos_id), None)
        adapter_params = sum(p.numel() for n, p in trainer.model.named_parameters() if f".{names[0]}." in n)
        load_peak = peak_bytes()
        reset_peak()
        trainer.train()
    baseline = 0 if ON_CUDA else RSS_AFTER_IMPORTS_KIB * 1024
    memory = {"imports": baseline, "load_peak": load_peak, "train_peak": peak_bytes()}
    print(json.dumps({**memory, "adapter_params": adapter_params}))


def peak_bytes():
    return torch.cuda.max_memory_allocated() if ON_CUDA else rss_kib() * 1024


def reset_peak():
    """Start a new peak: CUDA's peak statistics, or Linux's VmHWM once the heap freed while loading is handed back."""
    gc.collect()
    if ON_CUDA:
        return torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)  # glibc only
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def run_memory_worker(num_agents, batch, lora, quick):
    command = [sys.executable, __file__, "--memory-worker", str(num_agents), str(batch), lora]
    result = subprocess.run(command + (["--quick"] if quick else []), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"memory worker ({num_agents} agents) failed:\n{result.stderr[-3000:]}")
    worker = json.loads(result.stdout.strip().splitlines()[-1])
    adapter_params = worker.pop("adapter_params")
    m = {key: value / 2**20 for key, value in worker.items()}
    m["net"] = max(m["load_peak"], m["train_peak"]) - m["imports"]
    print(f"  {num_agents} agent(s), batch {batch}, {lora}: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in m.items()))
    return m, adapter_params


def bench_memory(s, quick):
    """4 agents vs 1 with the same number of sequences per micro-batch (the 1-agent run takes 4x the prompt copies):
    what the extra agents cost. The 4-agent run at the 1-agent batch (4x the sequences) is shown too."""
    what = "torch.cuda.max_memory_allocated" if ON_CUDA else "peak RSS net of imports"
    rows, small = [], s["mem_batch"]
    for lora in MEMORY_LORAS:
        one, adapter_params = run_memory_worker(1, 4 * small, lora, quick)
        four, _ = run_memory_worker(4, small, lora, quick)
        rows.append((f"memory {lora}: adapter parameters per agent", adapter_params, None))
        rows.append((f"memory {lora}: 1 agent, {4 * small} prompt copies, {what}, MiB", one["net"], None))
        rows.append((f"memory {lora}: 4 agents, {small} prompt copies, {what}, MiB", four["net"], None))
        rows.append((f"memory {lora}: ratio 4/1 agents, same sequences", four["net"] / one["net"], "memory"))
    held = (
        f"4-bit NF4 base, G={s['mem_generations']}, fixed completions of {s['mem_length']} tokens, "
        f"{s['mem_steps']} step(s); 1 agent x {4 * small} prompt copies vs 4 agents x {small} prompt copies = the "
        "same number of sequences per micro-batch; each configuration in its own process"
    )
    return rows, held


# -------------------------------------------------------------------------------------------------------- summary


def verdict(key, value):
    if key is None:
        return "", ""
    op, bound = TARGETS[key]
    ok = value <= bound if op == "<=" else value >= bound
    return f"{op} {bound}", "PASS" if ok else "MISS"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check that the script works")
    parser.add_argument("--only", choices=["step", "generate", "memory"], help="run one part only")
    parser.add_argument("--output", help="JSON summary (default: results/bench_core[_quick].json next to this file)")
    parser.add_argument("--memory-worker", nargs=3, metavar=("AGENTS", "BATCH", "LORA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    s = SETTINGS["quick" if args.quick else "full"]
    if args.memory_worker:
        num_agents, batch, lora = args.memory_worker
        return memory_worker(int(num_agents), int(batch), lora, s)

    torch.manual_seed(SEED)
    path, rows, held = default_model_path(), [], {}
    parts = [args.only] if args.only else ["step", "generate", "memory"]
    for part in parts:
        print(f"== {part}", flush=True)
        start = time.perf_counter()
        if part == "step":
            part_rows, held["step"] = bench_step(path, s)
        elif part == "generate":
            part_rows = [row for n in s["gen_agents"] for row in bench_generate(path, s, n)]
            held["generate"] = (
                f"{s['gen_prompts']} prompts answered by every agent, exactly {s['gen_tokens']} new tokens each, "
                f"sampling, LoRA r={LORA['r']} with random B, 1 warm-up + {s['gen_reps']} timed alternated reps"
            )
        else:
            part_rows, held["memory"] = bench_memory(s, args.quick)
        rows += part_rows
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)

    summary = {
        **run_header(
            torch_threads=torch.get_num_threads(),
            gpu=torch.cuda.get_device_name() if ON_CUDA else None,
            **{m.__name__: m.__version__ for m in (torch, transformers, trl, peft)},
        ),
        "settings": {"name": "quick" if args.quick else "full", **s},
        "held_equal": held,
        "results": [],
    }
    print("\n" + "=" * 100)
    for key in ("command", "date"):
        print(f"{key}: {summary[key]}")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in summary["machine"].items()))
    for part, text in held.items():
        print(f"held equal ({part}): {text}")
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'figure':<{width}} {'value':>10}  {'target':<8} result")
    for name, value, key in rows:
        target, result = verdict(key, value)
        shown = f"{value:>10.3f}" if isinstance(value, float) else f"{value:>10}"
        print(f"{name:<{width}} {shown}  {target:<8} {result}")
        summary["results"].append({"figure": name, "value": value, "target": target or None, "result": result or None})
    output = Path(args.output or Path(__file__).parent / "results" / f"bench_core{'_quick' * args.quick}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwritten to {output}")


if __name__ == "__main__":
    main()
