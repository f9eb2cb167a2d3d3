"""Checks the memory planner (`trl_marl.memory.estimate_memory`) against measured peak memory on the CPU. Prints
figures; not a test (tests/test_memory.py runs one configuration of it with a bound).

Each configuration trains `MAGRPOTrainer` for `STEPS` steps on the embedded default model (SmolLM2-135M-Instruct,
float32 or 4-bit NF4) in its own process, and compares the measured peak with the planner's prediction for the CPU
(`device="cpu"`: no CUDA context or allocator overhead, TRL's torch fallback of the fused log-prob head, fp32 4-bit
compute).

What is measured, and what is subtracted:
- Every row has the same prompt, and every completion has exactly C tokens — sampled with `min_new_tokens = C`
  (float32 runs, so the generation phase is measured too), or replaced by fixed token lists as in bench_core.py
  (4-bit runs: 4-bit generation is slow on the CPU; the generation phase is then not measured and the prediction
  compared is static + training phase). So the measured sequence length is the one the planner is given: P (the
  prompt's token count, recorded from the trainer's own tokenization) + C.
- Memory is the resident set (Linux /proc/self/status). Before the baseline, the process trains a tiny randomly
  initialised Llama with the same settings for one step, so that libraries, kernels and lazily imported code that a
  training step touches are already resident; then the tokenizer and dataset are built, the heap is trimmed, and the
  baseline is the RSS just before `MAGRPOTrainer(...)` loads the model. What is subtracted is therefore the Python
  process itself (interpreter, torch / transformers / TRL code and their first-use state, tokenizer, dataset), which
  on a GPU lives in host memory; what remains is what the planner predicts: weights, adapters, optimizer states,
  gradients, activations and generation buffers.
- After loading, every parameter is copied into its own buffer (`own_buffers`: loaders leave them as views of
  larger host buffers, which are not device memory on a GPU), then the peak is reset.
- Phases: the peak is reset (VmHWM via /proc/self/clear_refs) before each rollout (generation and scoring) and each
  optimisation part, and the larger peak over the steps is kept for each phase; measured = max(phase peaks) - baseline.
  The loading peak (file pages of the checkpoint, the fp32 copy before 4-bit quantization) is not part of it.
- glibc: the workers run with `MALLOC_MMAP_THRESHOLD_=131072`, so every buffer of 128 KiB or more is its own mapping,
  returned when freed; RSS then follows the live tensors instead of the allocator's high-water mark (a GPU's caching
  allocator has its own slack, which the planner's GPU overhead covers).

Usage, from the repository root:
    HF_HUB_OFFLINE=1 python recipes/benchmarks/bench_memory.py   # all configurations, 2.5-10 min each on 2 cores
    HF_HUB_OFFLINE=1 python recipes/benchmarks/bench_memory.py --only fp32-1a-gc   # one configuration
    ... [--output PATH]   # default results/bench_memory.json
"""

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_info import run_header  # noqa: E402

# name -> settings: 4-bit base, agents, prompt copies per micro-batch, G, completion tokens C, gradient checkpointing,
# sampled generation (else fixed completions). "test" is the configuration tests/test_memory.py measures.
CONFIGS = {
    "4bit-1a-gc": dict(four_bit=True, agents=1, batch=8, generations=4, completion=32, checkpointing=True),
    "4bit-2a-nogc": dict(four_bit=True, agents=2, batch=4, generations=4, completion=32, checkpointing=False),
    "4bit-4a-gc": dict(four_bit=True, agents=4, batch=4, generations=4, completion=32, checkpointing=True),
    "fp32-1a-gc": dict(four_bit=False, agents=1, batch=8, generations=4, completion=32, checkpointing=True),
    "fp32-2a-nogc": dict(four_bit=False, agents=2, batch=4, generations=4, completion=32, checkpointing=False),
    "fp32-4a-gc": dict(four_bit=False, agents=4, batch=2, generations=2, completion=32, checkpointing=True),
    "fp32-2a-gc-long": dict(four_bit=False, agents=2, batch=4, generations=4, completion=96, checkpointing=True),
    "test": dict(four_bit=False, agents=1, batch=2, generations=2, completion=8, checkpointing=True, sampled=False),
}
SUITE = [name for name in CONFIGS if name != "test"]
SEED, STEPS = 42, 2
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MMAP_THRESHOLD = "131072"


def rss_bytes(field: str = "VmHWM") -> int:
    """This process's peak ("VmHWM") or current ("VmRSS") resident set size in bytes (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def reset_peak() -> None:
    """Hand freed heap back to the system, then make VmHWM the current RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def magrpo_config(settings: dict, output_dir: str, **extra):
    """The `MAGRPOConfig` of a configuration: the worker trains it and the planner is given it."""
    from trl_marl import MAGRPOConfig

    return MAGRPOConfig(
        output_dir=output_dir,
        agents=[f"agent{i}" for i in range(settings["agents"])],
        per_device_train_batch_size=settings["batch"],
        num_generations=settings["generations"],
        max_completion_length=settings["completion"],
        gradient_checkpointing=settings["checkpointing"],
        lora_r=16,
        lora_target_modules=["all-linear"],
        learning_rate=1e-5,
        seed=SEED,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        **extra,
    )


def fixed_completions(prompt_ids, length, eos_id):
    """Deterministic token lists of `length` tokens ending in eos (as bench_core.py)."""
    return [
        [(sum(ids) + 7 * i + k) % 4000 + 100 for k in range(length - 1)] + [eos_id] for i, ids in enumerate(prompt_ids)
    ]


def is_sampled(settings: dict) -> bool:
    """Sampled generation (min_new_tokens = C), by default in float32; fixed completions in 4-bit (slow on the CPU)."""
    return settings.get("sampled", not settings["four_bit"])


def team_reward(prompts, completions, **kwargs):
    return [float(sum(len(text) for text in joint.values())) for joint in completions]


def build_trainer(model_path, settings, tokenizer, output_dir, max_steps):
    """A trainer whose every completion has exactly C tokens; records the longest prompt it tokenized."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback

    from trl_marl import MAGRPOTrainer
    from trl_marl.precision import four_bit_config

    length = settings["completion"]
    sampled = is_sampled(settings)
    args = magrpo_config(
        settings,
        output_dir,
        max_steps=max_steps,
        generation_kwargs={"min_new_tokens": length} if sampled else None,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}]] * 16})
    trainer = MAGRPOTrainer(
        model_path,
        team_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        quantization_config=four_bit_config() if settings["four_bit"] else None,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.longest_prompt = 0
    generate, eos_id = trainer._generate_single_turn, tokenizer.eos_token_id

    def generate_exactly(prompt_ids, *args, **kwargs):
        trainer.longest_prompt = max(trainer.longest_prompt, *(len(ids) for ids in prompt_ids))
        if sampled:
            completion_ids, logprobs = generate(prompt_ids, *args, **kwargs)
        else:
            completion_ids, logprobs = fixed_completions(prompt_ids, length, eos_id), None
        assert all(len(ids) == length for ids in completion_ids), "every completion must have exactly C tokens"
        return completion_ids, logprobs

    trainer._generate_single_turn = generate_exactly
    torch.manual_seed(SEED)
    return trainer


def own_buffers(model) -> None:
    """Copy every parameter into a buffer of its own. Loaders leave parameters as views of larger host buffers: the
    4-bit loader keeps about 250 MB of float32 staging alive through them on the CPU, and a float32 checkpoint stays
    a file mapping. Neither is device memory on a GPU; after this, RSS holds exactly the parameters."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()


class PhasePeaks:
    """Peak RSS of the rollout (generation + scoring) and of the optimisation part of each step."""

    def __init__(self, trainer):
        self.peaks = {"generation": 0, "training": 0}
        rollout = trainer._generate_and_score_completions

        def measured_rollout(inputs):
            self.close("training")  # what ran since the last reset: the previous step's optimisation
            try:
                return rollout(inputs)
            finally:
                self.close("generation")

        trainer._generate_and_score_completions = measured_rollout

    def close(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks[phase], rss_bytes())
        reset_peak()


def worker(name: str) -> None:
    """Runs in its own process: warm-up, baseline, load, train; prints one JSON line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    import transformers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trl_marl import default_model_path

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    settings = CONFIGS[name]
    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        # Warm-up: one step of a tiny model with the same settings loads what a step touches for the first time.
        tiny = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        LlamaForCausalLM(tiny).save_pretrained(f"{tmp}/tiny")
        build_trainer(f"{tmp}/tiny", settings, tokenizer, f"{tmp}/warm", max_steps=1).train()
        reset_peak()
        baseline = rss_bytes("VmRSS")
        start = time.perf_counter()
        trainer = build_trainer(model_path, settings, tokenizer, f"{tmp}/run", max_steps=STEPS)
        load_peak = rss_bytes()
        own_buffers(trainer.model)
        reset_peak()
        phases = PhasePeaks(trainer)
        trainer.train()
        phases.close("training")
        seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "baseline": baseline,
                "load_peak": load_peak,
                **{f"{phase}_peak": peak for phase, peak in phases.peaks.items()},
                "prompt_length": trainer.longest_prompt,
                "seconds": seconds,
            }
        )
    )


def run_worker(name: str) -> dict:
    """`worker(name)` in a fresh process; returns its JSON line (raises with its stderr if it failed)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"memory worker {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(name: str) -> dict:
    """Measure configuration `name` and predict it: the row of the results table (bytes, error in %)."""
    from transformers import AutoConfig

    from trl_marl import default_model_path
    from trl_marl.memory import estimate_memory

    settings = CONFIGS[name]
    measured = run_worker(name)
    with tempfile.TemporaryDirectory() as tmp:
        estimate = estimate_memory(
            magrpo_config(settings, tmp),
            AutoConfig.from_pretrained(default_model_path()),
            load_in_4bit=settings["four_bit"],
            prompt_length=measured["prompt_length"],
            device="cpu",
        )
    sampled = is_sampled(settings)
    generation = measured["generation_peak"] - measured["baseline"]
    training = measured["training_peak"] - measured["baseline"]
    predicted_training = estimate.static + estimate.training_phase
    predicted_generation = estimate.static + estimate.generation_phase
    if sampled:
        predicted, total = estimate.peak, max(generation, training)
    else:  # fixed completions: no generation ran
        predicted, total = predicted_training, training
    return {
        "config": name,
        **settings,
        "sampled_generation": sampled,
        "prompt_length": measured["prompt_length"],
        "sequences_per_micro_batch": estimate.details["training rows per micro-batch"],
        "sequence_length": estimate.details["training sequence length"],
        "predicted": predicted,
        "measured": total,
        "error_percent": 100 * (predicted - total) / total,
        "predicted_training": predicted_training,
        "measured_training": training,
        "predicted_generation": predicted_generation if sampled else None,
        "measured_generation": generation if sampled else None,
        "load_peak_over_baseline": measured["load_peak"] - measured["baseline"],
        "seconds": measured["seconds"],
        "breakdown_mib": {key: value / 2**20 for key, value in vars(estimate).items() if isinstance(value, int)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="these configurations only")
    parser.add_argument("--output", help="JSON results (default: results/bench_memory.json next to this file)")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    import trl_marl  # noqa: F401 (first: it filters a bitsandbytes notice that importing PEFT would print)

    # isort: split
    import peft
    import torch
    import transformers
    import trl

    rows = []
    for name in args.only or SUITE:
        row = check(name)
        rows.append(row)
        print(
            f"{name:<20} predicted {row['predicted'] / 2**20:7.0f} MiB  measured {row['measured'] / 2**20:7.0f} MiB"
            f"  error {row['error_percent']:+6.1f} %  ({row['seconds']:.0f} s)",
            flush=True,
        )
    mib = 2**20
    header = (
        f"\n{'config':<20} {'seq':>9} {'pred MiB':>9} {'meas MiB':>9} {'error':>7}   "
        f"{'train pred/meas':>16}   {'gen pred/meas':>14}"
    )
    print(header)
    for row in rows:
        sequences = f"{row['sequences_per_micro_batch']}x{row['sequence_length']}"
        train = f"{row['predicted_training'] / mib:.0f}/{row['measured_training'] / mib:.0f}"
        gen = (
            f"{row['predicted_generation'] / mib:.0f}/{row['measured_generation'] / mib:.0f}"
            if row["sampled_generation"]
            else "not run"
        )
        print(
            f"{row['config']:<20} {sequences:>9} {row['predicted'] / mib:>9.0f} {row['measured'] / mib:>9.0f} "
            f"{row['error_percent']:>+6.1f}%   {train:>16}   {gen:>14}"
        )
    summary = {
        **run_header(
            torch_threads=torch.get_num_threads(),
            gpu=None,
            **{m.__name__: m.__version__ for m in (torch, transformers, trl, peft)},
        ),
        "method": "peak RSS per phase minus the RSS just before the model loads (after a warm-up step of a tiny "
        f"model); MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}; {STEPS} steps, LoRA r=16 all-linear",
        "results": rows,
    }
    output = Path(args.output or Path(__file__).parent / "results" / "bench_memory.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwritten to {output}")


if __name__ == "__main__":
    main()
