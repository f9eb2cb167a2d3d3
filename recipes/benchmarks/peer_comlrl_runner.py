"""The CoMLRL side of `bench_peer.py`, run by the CoMLRL virtual environment's Python (no trl, peft or trl_marl there).

    <comlrl venv>/bin/python peer_comlrl_runner.py SPEC.json

SPEC.json (written by `bench_peer.py`) holds the model folder, the agents, each agent's prompts already rendered with
the chat template, and the settings. The runner trains CoMLRL's `MAGRPOTrainer` (one full model copy and one AdamW
per agent) on them and prints one JSON line: the end time of every prompt's step, the completion lengths, and the
memory. It also holds the measuring helpers that the trl_marl side uses (`bench_peer.py` imports them from here), so
both sides measure alike.
"""

import contextlib
import ctypes
import gc
import importlib.util
import json
import random
import resource
import sys
import time
import types
from importlib.metadata import version
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def rss_kib(field: str = "VmHWM") -> int:
    """This process's peak ("VmHWM") or current ("VmRSS") resident set size in KiB (`ru_maxrss` without /proc)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def baseline_bytes() -> int:
    """What the peak is net of: the RSS now (call it after the imports, before loading a model); 0 on CUDA, whose
    peak counts tensors only."""
    return 0 if torch.cuda.is_available() else rss_kib("VmRSS") * 1024


def peak_bytes() -> int:
    """`torch.cuda.max_memory_allocated()` on CUDA, else this process's peak RSS (VmHWM)."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else rss_kib() * 1024


def reset_peak() -> None:
    """Start a new peak: CUDA's peak statistics, or Linux's VmHWM once the heap freed while loading is handed back
    (as bench_core.py, which this environment cannot import)."""
    gc.collect()
    if torch.cuda.is_available():
        return torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)  # glibc only
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def clock() -> float:
    """`time.perf_counter()` once the device has finished its queued work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def load_trl_marl_module(relative_path: str) -> types.ModuleType:
    """Load one of trl_marl's task modules by path, without importing the `trl_marl` package (whose `__init__`
    needs trl and peft, absent here). Its package imports are the `Task` base class, stubbed, and the standalone
    `trl_marl.tasks.completions`, loaded by path too: the team reward is then the very function the trl_marl side
    trains on. A new package import in that module fails here, loudly."""
    stub_package, stub_tasks, stub_base = (
        types.ModuleType(name) for name in ("trl_marl", "trl_marl.tasks", "trl_marl.tasks.base")
    )
    stub_package.__path__, stub_tasks.__path__ = [], []
    stub_base.Task = type("Task", (), {})
    sys.modules.update({"trl_marl": stub_package, "trl_marl.tasks": stub_tasks, "trl_marl.tasks.base": stub_base})
    module = None
    for path in ("trl_marl/tasks/completions.py", relative_path):
        name = "trl_marl.tasks." + Path(path).stem
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def comlrl_team_reward(team_reward, agent_names: list[str]):
    """A trl_marl team reward (`completions`: one {agent: text} dict per joint action) in CoMLRL's calling
    convention: one positional list of completions per agent, in agent order."""

    def reward(*completions_per_agent):
        joint_actions = [dict(zip(agent_names, texts)) for texts in zip(*completions_per_agent)]
        rewards = team_reward(None, joint_actions)
        reward.history.extend(rewards)
        return rewards

    reward.history = []  # every reward given, to report their mean
    return reward


def tokenizer_with_distinct_pad(tokenizer, agent_prompts: dict[str, list[str]]):
    """The tokenizer with a pad token that no prompt contains.

    CoMLRL takes a prompt to end at its first pad token (`_generate_completions`). SmolLM2's pad token is its eos,
    `<|im_end|>`, which the chat template puts after every message: CoMLRL would cut each prompt after the system
    message, train on the rest of the prompt as if generated, and score empty completions. Its `<|endoftext|>`
    (id 0) occurs in no prompt; generation still stops at eos (`<|im_end|>`), as on the trl_marl side.
    """
    tokenizer.pad_token = "<|endoftext|>"
    pad_id = tokenizer.pad_token_id
    for texts in agent_prompts.values():
        for text in texts:
            if pad_id in tokenizer(text).input_ids:
                raise ValueError(f"The pad token {tokenizer.pad_token!r} occurs in the prompt {text!r}.")
    return tokenizer


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    import transformers
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from datasets import Dataset
    from transformers import AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    memory_baseline = baseline_bytes()  # after the imports, before any model
    seed_everything(spec["seed"])

    names = spec["agent_names"]
    tasks = load_trl_marl_module(spec["reward_module"])
    reward = comlrl_team_reward(getattr(tasks, spec["reward_function"]), names)
    dataset = Dataset.from_dict({name: spec["agent_prompts"][name] for name in names})
    tokenizer = tokenizer_with_distinct_pad(AutoTokenizer.from_pretrained(spec["model_path"]), spec["agent_prompts"])
    config = MAGRPOConfig(
        num_train_epochs=1,
        agent_learning_rate=spec["learning_rate"],
        logging_steps=1,
        num_agents=len(names),
        num_generations=spec["num_generations"],
        max_new_tokens=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,  # 0 turns top-k off in transformers, as TRL's default does
        num_turns=1,
        eval_interval=0,
        rollout_buffer_size=1,  # each agent updates after every prompt, as trl_marl with one prompt per step
        train_batch_size=1,
        advantage_mode="mean",
        advantage_normalization=True,
    )
    trainer = MAGRPOTrainer(
        agent_model=spec["model_path"],
        num_agents=len(names),
        tokenizer=tokenizer,
        train_dataset=dataset,
        reward_func=reward,
        formatters=[lambda item, name=name: item[name] for name in names],  # prompts arrive rendered
        model_config={"torch_dtype": torch.float32},
        args=config,
    )
    trainer.verbose = False  # no tqdm bar
    load_peak = peak_bytes()
    reset_peak()

    step_end_times, completion_lengths = [], []
    train_step, generate = trainer._train_step_returns, trainer._generate_completions

    def timed_train_step(*args, **kwargs):  # one prompt: both agents generate, are rewarded and take their update
        train_step(*args, **kwargs)
        step_end_times.append(clock())

    def measured_generate(*args, **kwargs):
        completions = generate(*args, **kwargs)
        completion_lengths.extend(completions["response_lens"])
        return completions

    trainer._train_step_returns, trainer._generate_completions = timed_train_step, measured_generate
    step_end_times.append(clock())
    trainer.train(min_new_tokens=spec["max_new_tokens"])  # forwarded to `generate`: every completion is full length

    result = {
        "side": "comlrl",
        "device": device_name(),
        "threads": torch.get_num_threads(),
        "versions": {
            "comlrl": version("comlrl"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "start_time": step_end_times[0],
        "step_end_times": step_end_times[1:],
        "completion_lengths": completion_lengths,
        "mean_team_reward": sum(reward.history) / len(reward.history),
        "trainable_parameters": sum(
            p.numel() for agent in trainer.agents for p in agent.parameters() if p.requires_grad
        ),
        "memory_baseline_bytes": memory_baseline,
        "memory_load_peak_bytes": load_peak,
        "memory_train_peak_bytes": peak_bytes(),
        "rss_file_end_bytes": rss_kib("RssFile") * 1024,  # file-backed part of the RSS (memory-mapped checkpoints)
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
