"""Run this first on a new machine: what trl_marl will use there, and a 2-step team training run that proves it works.

    python recipes/gpu_check.py                      # prints the report; exit code 1 if a check that ran failed
    python recipes/gpu_check.py --json report.json   # also writes it as JSON

It reports the device (name, memory, compute capability), bf16/fp16 support and the precision trl_marl picks,
bitsandbytes 4-bit on CUDA, SDPA and flash-attention, the memory planner's prediction for a paper recipe against this
GPU's free memory, the decode path the team generates with (`captured_decode`'s choice for this device: its ms per
decode step against eager `generate`, and whether their greedy tokens are equal), and then trains two agents for two
steps on the embedded default model (a 4-bit base on a GPU, a float32 one on the CPU) with KL to the base on: step
time, peak memory, and whether every agent's adapter moved. On a machine without a CUDA GPU, each GPU-only check says
that it was skipped and why.
"""

import argparse
import importlib.util
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import trl_marl  # noqa: F401 (first: it filters a bitsandbytes notice that importing PEFT would print)

# isort: split
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.cli.command import estimate_config
from trl_marl.generation.captured_decode import CapturedDecoder, captured_decoder, describe
from trl_marl.generation.routing import AdapterRouter
from trl_marl.precision import default_mixed_precision, four_bit_config, half_precision_dtype

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "benchmarks"))
from bench_decode import load, measure, prompts, with_adapters  # noqa: E402

GIB = 1024**3
NO_GPU = "no CUDA GPU on this machine"


class Report:
    def __init__(self):
        self.checks, self.facts = [], {}

    def add(self, name: str, status: str, detail: str) -> None:
        """`status`: "ok", "failed" (a check that ran and did not pass) or "skipped" (with the reason)."""
        self.checks.append({"name": name, "status": status, "detail": detail})
        print(f"[{status:>7}] {name}: {detail}", flush=True)

    def run(self, name: str, check) -> None:
        """Run `check()` → (status, detail); an exception is a failed check, named."""
        try:
            status, detail = check()
        except Exception as error:  # the report goes on: one broken piece must not hide the others
            status, detail = "failed", f"{type(error).__name__}: {error}"
        self.add(name, status, detail)

    @property
    def failed(self) -> list[str]:
        return [check["name"] for check in self.checks if check["status"] == "failed"]


def device_check():
    if not torch.cuda.is_available():
        return (
            "skipped",
            f"{NO_GPU} (torch {torch.__version__}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores)",
        )
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    return "ok", (
        f"{props.name}, compute capability {props.major}.{props.minor}, {total / GIB:.1f} GiB "
        f"({free / GIB:.1f} free), torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def precision_check():
    on_gpu = torch.cuda.is_available()
    _, fp16 = default_mixed_precision(None, False, use_cpu=not on_gpu)
    if not on_gpu:
        return "ok", "CPU: trl_marl trains in float32 (bf16 autocast is emulated on most CPUs)"
    choice = "fp16" if fp16 else "bf16"  # None: TRL's default, bf16
    return "ok", f"bf16 supported: {torch.cuda.is_bf16_supported()}; trl_marl picks {choice} mixed precision"


def four_bit_check():
    if not torch.cuda.is_available():
        return "skipped", f"{NO_GPU}: bitsandbytes' CUDA 4-bit kernels cannot be tried"
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(64, 64, compute_dtype=half_precision_dtype(), quant_type="nf4").cuda()
    output = layer(torch.randn(2, 64, device="cuda", dtype=half_precision_dtype()))
    if not torch.isfinite(output).all():
        return "failed", "a 4-bit NF4 layer gave non-finite outputs"
    return "ok", f"bitsandbytes {bnb.__version__}: a 4-bit NF4 layer runs on CUDA"


def attention_check():
    sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    flash_attn = importlib.util.find_spec("flash_attn") is not None
    detail = f"SDPA: {sdpa}; flash-attn package: {flash_attn}"
    if torch.cuda.is_available():
        detail += f"; SDPA flash kernel enabled: {torch.backends.cuda.flash_sdp_enabled()}"
    return ("ok" if sdpa else "failed"), detail


def plan_check(recipe: str, model_config: str):
    estimate = estimate_config(recipe, ["--model_name_or_path", model_config])
    predicted = f"{Path(recipe).name}: predicted peak {estimate.peak / GIB:.1f} GiB ({estimate.peak_phase})"
    if not torch.cuda.is_available():
        return "skipped", f"{predicted}; {NO_GPU} to compare it with"
    free = torch.cuda.mem_get_info()[0]
    if estimate.peak > free:
        return "failed", f"{predicted} > {free / GIB:.1f} GiB free: lower the batch or the lengths (docs/memory.md)"
    return "ok", f"{predicted} <= {free / GIB:.1f} GiB free"


def decode_check(report: Report):
    """The team's decode path on this device (the default of `captured_decode`), timed against eager `generate` on
    2 agents × 8 rows of the default model, greedy. Where the default is eager (a CPU), the static-cache loop of the
    captured path, with an eager step, is what gets compared. Failed when the captured step failed (and fell back);
    greedy rows that differ are reported, not failed: in bf16 a static cache alone rounds differently from eager
    `generate`'s growing one (transformers' own static-cache `generate` differs from its default there too)."""
    on_gpu = torch.cuda.is_available()
    model, names = with_adapters(load("4bit" if on_gpu else "fp32", "cuda" if on_gpu else "cpu"), 2)
    router = AdapterRouter(model, names)
    chosen = captured_decoder(model, router, None)
    decoder = chosen or CapturedDecoder(model, router, path="static")
    input_ids, attention_mask = prompts(AutoTokenizer.from_pretrained(default_model_path()), 8, model.device)
    figures = measure(model, decoder, router, [names[row % 2] for row in range(8)], input_ids, attention_mask, 16, 3)
    report.facts["decode"] = {"path": describe(chosen), "compared": describe(decoder), **figures}
    detail = (
        f"in use: {describe(chosen)}; eager generate {figures['eager_ms']:.1f} ms per decode step, "
        f"{describe(decoder)} {figures['captured_ms']:.1f} ms ({figures['speedup']}x), greedy tokens equal in "
        f"{figures['equal_rows']} of 8 rows; warm-up of the captured path {figures['captured_warmup_s']} s in its "
        f"first call (recording or compiling per rows x cache length: {figures['captured_shapes_s']})"
    )
    return ("failed" if decoder.failure else "ok"), detail


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def team_reward(prompts, completions, **kwargs):
    return [len(c["detailed"]) / (1.0 + len(c["concise"])) for c in completions]


def training_check(report: Report, steps: int):
    on_gpu = torch.cuda.is_available()
    agents = [{"name": "concise", "system_prompt": "Answer in a few words."}, {"name": "detailed"}]
    questions = ["What is 3 plus 4?", "What colour is snow?"]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})
    with tempfile.TemporaryDirectory() as output_dir:
        args = MAGRPOConfig(
            output_dir=output_dir,
            agents=agents,
            num_generations=2,
            per_device_train_batch_size=4 if on_gpu else 2,  # prompt copies: 2 prompts a step on a GPU, 1 on a CPU
            max_completion_length=16 if on_gpu else 4,
            max_steps=steps,
            learning_rate=1e-3,
            beta=0.04,  # KL to the base: the path that must keep every agent training
            report_to="none",
            save_strategy="no",
            use_cpu=not on_gpu,
        )
        trainer = MAGRPOTrainer(
            default_model_path(),
            team_reward,
            args=args,
            train_dataset=dataset,
            quantization_config=four_bit_config() if on_gpu else None,
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        times = StepTimes()
        trainer.add_callback(times)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        after = dict(trainer.model.named_parameters())
    moved = {
        agent["name"]: any(
            not torch.equal(value, after[name].detach())
            for name, value in before.items()
            if f".{agent['name']}." in name
        )
        for agent in agents
    }
    if on_gpu:
        peak = f"peak GPU memory {torch.cuda.max_memory_allocated() / GIB:.2f} GiB"
    else:
        peak = f"peak process memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f} GiB"
    base = "4-bit NF4" if on_gpu else "float32"
    report.facts["training"] = {"step_seconds": times.times, "adapters_moved": moved, "peak": peak, "base": base}
    status = "ok" if all(moved.values()) else "failed"
    still = [name for name, changed in moved.items() if not changed]
    detail = (
        f"{len(agents)} agents, {steps} steps on a {base} base with KL: "
        f"{sum(times.times) / max(1, len(times.times)):.2f} s/step, {peak}; adapters moved: {moved}"
        + (f"; did not train: {still}" if still else "")
    )
    return status, detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the report to this JSON file")
    parser.add_argument("--recipe", default=str(HERE / "paper" / "magrpo_humaneval.yaml"), help="config to plan")
    parser.add_argument(
        "--model_config",
        default=str(HERE / "paper" / "model_configs" / "Qwen2.5-Coder-3B"),
        help="the recipe's model config.json folder (read offline)",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps of the team run")
    arguments = parser.parse_args()

    report = Report()
    report.facts["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    report.run("device", device_check)
    report.run("precision", precision_check)
    report.run("bitsandbytes 4-bit on CUDA", four_bit_check)
    report.run("attention", attention_check)
    report.run("memory plan", lambda: plan_check(arguments.recipe, arguments.model_config))
    report.run("decode step", lambda: decode_check(report))
    report.run("team training", lambda: training_check(report, arguments.steps))

    failed = report.failed
    print("\n" + (f"FAILED: {', '.join(failed)}" if failed else "All checks that could run passed."), flush=True)
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({**report.facts, "checks": report.checks}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
