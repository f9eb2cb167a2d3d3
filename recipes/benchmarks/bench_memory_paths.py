"""Peak memory of each way trl_marl trains, against TRL's `GRPOTrainer` with one LoRA on the same work. Prints figures;
not a test.

Every arm trains `--steps` steps on the embedded default model (SmolLM2-135M-Instruct, float32, the CPU) in its own
process, one after the other, with the same LoRA (r 16 on TRL's default modules), the same prompt (about 250 tokens,
as `recipes/tool_team.py`'s with its tool schema), 16 training rows per micro-batch and 48-token completions:

- `trl`: `GRPOTrainer`, 4 prompts x G=4;
- `trl_released`: the same with `callbacks=[ReleaseFreeMemory()]`: free memory back to the system after each step,
  as the team trainers do (TRL's resident set otherwise grows from step to step on the CPU: docs/memory.md);
- `magrpo`: `MAGRPOTrainer`, 2 agents, 2 prompts x G=4 (16 rows: 8 per agent);
- `atgrpo`: `ATGRPOTrainer`, 2 agents acting in turn, 2 prompts x K=4;
- `trl_tools` / `magrpo_tools`: as `trl` / `magrpo` with TRL's `tools=[add]`: every first answer calls `add`, the
  result is appended (masked out of the loss) and the agent answers;
- `magrpo_sampled` / `program`: 2 agents, their completions sampled (at most 48 tokens), by the built-in rollout or by
  an agent program calling both agents through the trainer's own endpoint (`episode=`, `recipes/benchmarks/
  bench_program.py`'s parity episode);
- `agents_sdk`: an agent program written with the OpenAI Agents SDK (`openai-agents`), docs/programs.md's weather
  report: `writer` must call a `weather` function tool (`tool_choice` required, chat completions API), then `critic`
  judges the report in a typed answer (`output_type`, Responses API); 8 episodes a step (2 questions x G=4), 16 rows
  (a call of each agent per episode), each prompt short but the writer's carrying the tool's schema. No reference
  of the same work: its peak is set against the 8 GB target.

The other arms' completions are fixed token lists (`bench_core.fixed_completions`: 48 tokens ending in EOS), so those
arms train on the same tokens. Memory is the resident set (Linux `/proc/self/status`): after each training step the
peak since the previous step (`VmHWM`, then reset) and the resident set (`VmRSS`) are read; `before` is the resident
set after imports and the dataset, just before the trainer is built. Printed per arm: the highest step peak, it net of
`before`, the first and last step's floors (growth), and the ratio of each arm's highest peak, and of its first step's,
to its reference's (`trl`, or `trl_tools`, or `magrpo_sampled` for `program`; the team arms also to `trl_released`).
The targets (docs/benchmarks.md): every arm within 1.2x its reference.

    python recipes/benchmarks/bench_memory_paths.py                     # all arms, ~25 min on 2 idle CPU cores
    python recipes/benchmarks/bench_memory_paths.py --arms trl magrpo   # some
    ... [--steps 4] [--gradient_checkpointing] [--out PATH]             # default results/bench_memory_paths.json
    ... [--micro_batches 4]     # a step's 16 rows in 4 micro-batches of 4 (gradient accumulation), every arm alike
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl_marl.memory.measured import GIB, reset_peak_resident, status_bytes  # noqa: E402

ARMS = (
    *("trl", "trl_released", "magrpo", "atgrpo"),
    *("trl_tools", "magrpo_tools", "magrpo_sampled", "program", "agents_sdk"),
)
REFERENCE = {  # each arm's reference; the team arms' also against `trl_released`, which gives memory back as they do
    "magrpo": "trl",
    "atgrpo": "trl",
    "magrpo_tools": "trl_tools",
    "program": "magrpo_sampled",
}
RELEASED_REFERENCE = {"magrpo": "trl_released", "atgrpo": "trl_released"}
EPISODES = ("program", "agents_sdk")  # the arms trained from an agent program
ROWS, COMPLETION, G = 16, 48, 4
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 47, "b": 18}}\n</tool_call>'
# About 250 tokens with the chat template, as tool_team.py's prompts are with their tool schema.
PROMPT = (
    "You are the calculator of a small team. Read the question, find its two numbers and add them. "
    "Reply with the sum only, as digits, and nothing else: no words, no units, no explanation. "
) * 5 + "What is 47 plus 18?"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def reward(prompts, completions, **kwargs):
    """Any spread of rewards (the advantages are not what is measured): the answers' lengths."""
    texts = [c[-1]["content"] if isinstance(c, list) else " ".join(c.values()) for c in completions]
    return [float(len(text) % 7) for text in texts]


def scripted(tokenizer, tools: bool):
    """`_generate_single_turn`'s stand-in: fixed completions of `COMPLETION` tokens; with `tools`, a first answer
    calls `add` and an answer after its result is fixed text."""
    from bench_core import fixed_completions

    eos = tokenizer.eos_token_id
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]

    def generate(prompt_ids, *args, **kwargs):
        if not tools:
            return fixed_completions(prompt_ids, COMPLETION, eos), None
        answers = fixed_completions(prompt_ids, COMPLETION, eos)
        return [
            answer if "<tool_response>" in tokenizer.decode(ids[-30:]) else list(call)
            for ids, answer in zip(prompt_ids, answers)
        ], None

    return generate


def both_agents(client, row) -> float:
    """The program arm's episode: each agent answers the prompt once, both calls sent at once; `reward`'s value."""
    from bench_program import each_agent_at_once

    return float(len(" ".join(text or "" for text in each_agent_at_once(client, row).values())) % 7)


WEATHER_QUESTIONS = ["What is the weather in Paris today?", "Is it raining in Rome?"]


async def weather_report(client, row) -> float:
    """The agents_sdk arm's episode (docs/programs.md's): `writer` looks the weather up, `critic` judges the report."""
    from typing import Literal

    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
    from pydantic import BaseModel

    class Verdict(BaseModel):
        correct: bool

    @function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """Today's weather in a city."""
        return f"sunny in {city}" if city == "Paris" else f"rain in {city}"

    question = row["prompt"][-1]["content"]
    run_config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    writer = Agent(
        name="writer",
        model="writer",
        tools=[weather],
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False),
        tool_use_behavior="stop_on_first_tool",
    )
    report = (await Runner.run(writer, question, run_config=run_config, max_turns=2)).final_output
    critic = Agent(name="critic", model="critic", output_type=Verdict)
    shown = f"{question}\nThe report: {report}. Is it right?"
    verdict = (await Runner.run(critic, shown, run_config=run_config)).final_output
    return float(verdict.correct)


def train_arm(arm: str, steps: int, gradient_checkpointing: bool, micro_batches: int = 1) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, default_model_path
    from trl_marl.generation.tool_templates import CHATML_TOOLS, prepare_response_parsing, tool_chat_template
    from trl_marl.memory.host import ReleaseFreeMemory

    model = default_model_path()
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}]] * 64})
    settings = dict(
        output_dir=f"/tmp/bench-memory-paths-{arm}", max_completion_length=COMPLETION, num_generations=G,
        max_steps=steps, learning_rate=5e-4, seed=0, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=True, bf16=False, gradient_checkpointing=gradient_checkpointing,
        gradient_accumulation_steps=micro_batches,  # TRL generates every micro-batch's rows at once, then splits them
    )  # fmt: skip
    rows = ROWS // micro_batches  # per micro-batch; a step's rows stay ROWS
    lora = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM")
    team = [{"name": "concise"}, {"name": "detailed"}]  # the names bench_program's parity episode calls
    if arm == "agents_sdk":
        team = [{"name": "writer"}, {"name": "critic"}]
        questions = [[{"role": "user", "content": question}] for question in WEATHER_QUESTIONS]
        dataset = Dataset.from_dict({"prompt": questions * 32})
        settings["episode_max_failed_fraction"] = 1.0  # a failed episode is left out; memory is what is measured
    tools = arm.endswith("_tools")
    extra = {"tools": [add]} if tools else {}
    if tools:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.chat_template = tool_chat_template(tokenizer, CHATML_TOOLS)
        prepare_response_parsing(tokenizer, CHATML_TOOLS)
        extra["processing_class"] = tokenizer
    before = status_bytes("VmRSS")
    if arm.startswith("trl"):
        args = GRPOConfig(per_device_train_batch_size=rows, **settings)
        if arm == "trl_released":
            extra["callbacks"] = [ReleaseFreeMemory()]
        trainer = GRPOTrainer(model, reward, args=args, train_dataset=dataset, peft_config=lora, **extra)
    elif arm == "atgrpo":
        args = ATGRPOConfig(agents=team, per_device_train_batch_size=rows // 2, **settings)
        trainer = ATGRPOTrainer(model, reward, args=args, train_dataset=dataset, peft_config=lora)
    else:
        args = MAGRPOConfig(agents=team, per_device_train_batch_size=rows // 2, **settings)
        episode = {"episode": {"program": both_agents, "agents_sdk": weather_report}[arm]} if arm in EPISODES else {}
        rewards = None if arm in EPISODES else reward
        trainer = MAGRPOTrainer(model, rewards, args=args, train_dataset=dataset, peft_config=lora, **extra, **episode)
    if arm not in ("magrpo_sampled", *EPISODES):
        trainer._generate_single_turn = scripted(trainer.processing_class, tools)
    load_peak = status_bytes("VmHWM")

    class PerStep(TrainerCallback):
        peaks, floors = [], []

        def on_train_begin(self, *unused, **kwargs):
            reset_peak_resident()

        def on_step_end(self, *unused, **kwargs):
            self.peaks.append(status_bytes("VmHWM"))
            self.floors.append(status_bytes("VmRSS"))
            reset_peak_resident()

    trainer.add_callback(PerStep())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]  # a step's log
    return {
        "before": before,
        "load_peak": load_peak,
        "step_peaks": PerStep.peaks,
        "step_floors": PerStep.floors,
        "rows_per_step": [entry.get("num_samples", ROWS) for entry in logs],  # GRPOTrainer trains ROWS, logs none
        "completion_length": [entry["completions/mean_length"] for entry in logs],
        "failed_episodes": [entry.get("episodes/failed", 0) for entry in logs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--micro_batches", type=int, default=1, choices=[1, 2, 4, 8])
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if options.worker:
        figures = train_arm(options.worker, options.steps, options.gradient_checkpointing, options.micro_batches)
        print(json.dumps(figures))
        return
    from run_info import run_header

    results = {**run_header(), "steps": options.steps, "gradient_checkpointing": options.gradient_checkpointing}
    results["micro_batches"] = options.micro_batches
    arms = {}
    for arm in options.arms:
        command = [sys.executable, __file__, "--worker", arm, "--steps", str(options.steps)]
        command += ["--gradient_checkpointing"] if options.gradient_checkpointing else []
        command += ["--micro_batches", str(options.micro_batches)]
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode != 0:
            raise RuntimeError(f"arm {arm} failed:\n{finished.stderr[-3000:]}")
        figures = json.loads(finished.stdout.strip().splitlines()[-1])
        figures["peak"] = max(figures["step_peaks"])
        figures["net_peak"] = figures["peak"] - figures["before"]
        arms[arm] = figures
        print(
            f"{arm:15s} peak {figures['peak'] / GIB:5.2f} GiB (net {figures['net_peak'] / GIB:5.2f}), floor "
            f"{figures['step_floors'][0] / GIB:5.2f} -> {figures['step_floors'][-1] / GIB:5.2f} GiB, rows/step "
            f"{figures['rows_per_step']}, mean completion {sum(figures['completion_length']) / options.steps:.1f}",
            flush=True,
        )
    ratios = {}
    for arm, reference in [*REFERENCE.items(), *RELEASED_REFERENCE.items()]:
        if arm in arms and reference in arms:
            ratios[f"{arm}/{reference}"] = ratio = arms[arm]["peak"] / arms[reference]["peak"]
            first = arms[arm]["step_peaks"][0] / arms[reference]["step_peaks"][0]
            print(f"{arm} / {reference} peak: {ratio:.2f}, step 1 alone: {first:.2f} (target <= 1.2)")
    results.update(arms=arms, ratios=ratios)
    out = options.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_memory_paths.json")
    with open(out, "w") as file:
        json.dump(results, file, indent=2)
    print(f"Written: {out}")


if __name__ == "__main__":
    main()
