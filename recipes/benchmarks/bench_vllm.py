"""Team generation through vLLM (one engine, one LoRA per agent) against the routed transformers `generate`, on the
default model. Prints figures; not a test. Needs vLLM (docs/vllm.md, Install).

Both backends generate exactly `--tokens` new tokens per row (EOS ignored), greedy, float32, for 2 and 4 agents and
16-64 rows; the two alternate within each round, so each ratio comes from one run. Also reported: the engine's start
and the cost of one adapter-only sync.

    python recipes/benchmarks/bench_vllm.py            # ~5 min on 2 CPU cores
    python recipes/benchmarks/bench_vllm.py --rows 16 64 --rounds 3
"""

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as TRL's colocate

import trl_marl  # noqa: E402, F401 (first: it filters a bitsandbytes notice that importing PEFT would print)

# isort: split
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_marl import default_model_path  # noqa: E402
from trl_marl.generation.routing import AdapterRouter  # noqa: E402
from trl_marl.generation.vllm_generation import TeamVLLMGeneration  # noqa: E402

ADAPTERS = ["a0", "a1", "a2", "a3"]
QUESTIONS = ["Name a fruit.", "What is 2 + 3?", "Say hello.", "Name a colour.", "Describe rain.", "Count to five."]


def build(tokens: int, rank: int):
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config, ADAPTERS[0])
    for name in ADAPTERS[1:]:
        model.add_adapter(name, config)
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.03)
    router = AdapterRouter(model, ADAPTERS)
    step = {"value": 0}
    start = time.perf_counter()
    engine = TeamVLLMGeneration(
        model,
        row_adapters=lambda: router.row_adapters,
        adapter_names=ADAPTERS,
        current_step=lambda: step["value"],
        trained_adapters=ADAPTERS,
        lora_rank=rank,
        accelerator=Accelerator(cpu=True),
        processing_class=tokenizer,
        gpu_memory_utilization=0.3,
        max_model_length=512,
        max_num_seqs=64,
        temperature=0.0,
        max_completion_length=tokens,
        generation_kwargs={"ignore_eos": True},
    )
    started = time.perf_counter() - start
    return tokenizer, model, router, engine, step, started


def prompts(tokenizer, count: int) -> list[list[int]]:
    messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]
    return [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"] for m in messages
    ]


def through_vllm(engine, router, rows, adapters) -> int:
    router.route(adapters)
    try:
        return sum(len(ids) for ids in engine.generate(rows, None, 1)[1])
    finally:
        router.route(None)


def through_generate(tokenizer, model, router, rows, adapters, tokens: int) -> int:
    batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")
    router.route(adapters)
    try:
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    finally:
        router.route(None)
    return (output.size(1) - batch["input_ids"].size(1)) * output.size(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--agents", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")

    tokenizer, model, router, engine, step, started = build(options.tokens, options.rank)
    syncs = []
    for _ in range(3):
        start = time.perf_counter()
        engine.sync_weights()
        syncs.append(time.perf_counter() - start)
        step["value"] += 1
    print(f"engine start: {started:.1f} s; adapter-only sync of {len(ADAPTERS)} rank-{options.rank} adapters: "
          f"{statistics.median(syncs):.2f} s (median of 3; the first loads them all)")  # fmt: skip
    through_vllm(engine, router, prompts(tokenizer, 4), ADAPTERS)  # warm-up
    through_generate(tokenizer, model, router, prompts(tokenizer, 4), ADAPTERS, 4)

    print(f"\n{options.tokens} new tokens a row")
    print("| agents | rows | vLLM tok/s | routed generate tok/s | vLLM / generate |")
    print("|---|---|---|---|---|")
    for num_agents in options.agents:
        for num_rows in options.rows:
            rows = prompts(tokenizer, num_rows)
            adapters = [ADAPTERS[i % num_agents] for i in range(num_rows)]
            rates = {"vllm": [], "generate": []}
            for _ in range(options.rounds):
                start = time.perf_counter()
                made = through_vllm(engine, router, rows, adapters)
                rates["vllm"].append(made / (time.perf_counter() - start))
                start = time.perf_counter()
                made = through_generate(tokenizer, model, router, rows, adapters, options.tokens)
                rates["generate"].append(made / (time.perf_counter() - start))
            vllm, generate = (statistics.median(rates[key]) for key in ("vllm", "generate"))
            print(f"| {num_agents} | {num_rows} | {vllm:.0f} | {generate:.0f} | {vllm / generate:.2f}x |")
    engine.close()


if __name__ == "__main__":
    main()
