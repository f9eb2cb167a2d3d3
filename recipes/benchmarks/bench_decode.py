"""Milliseconds per decode step of the team's generation, eager `generate` against the captured decode step
(`trl_marl.generation.captured_decode`), on the embedded default model (SmolLM2-135M-Instruct). Prints figures; not a
test.

For each precision and row count, five models: the base alone; one PEFT adapter (PEFT's own forward, no router);
the team's router with 2 and 4 agents (rows spread evenly over the agents, LoRA B randomised so the adapters differ),
and 4 agents again with the LoRA matmuls of layers sharing an input left ungrouped (`tensor_routing.py`); then the
captured step of 4 agents over the base's, fused and unfused (`team_over_base`).
Each is timed eager and on the captured path. A decode step's time is `(t(T) - t(1)) / (T - 1)`, with `t(n)` the best
of `--repeats` generate calls making exactly n tokens per row (`min_new_tokens = max_new_tokens`), so the prefill and
the call's fixed costs cancel; the captured path is warmed (compiled) first. Greedy: the captured tokens are compared
with eager's, row by row ("equal").

Usage, from the repository root:
    HF_HUB_OFFLINE=1 PYTHONPATH=. python recipes/benchmarks/bench_decode.py --quick   # check the script (CPU, ~5 min)
    HF_HUB_OFFLINE=1 PYTHONPATH=. python recipes/benchmarks/bench_decode.py           # CPU: fp32, 16 rows
    python recipes/benchmarks/bench_decode.py --rows 16 64 --precision bf16 4bit       # a GPU: graphs, bf16 and 4-bit
    python recipes/benchmarks/bench_decode.py --rows 16 --precision bf16 \
        --model_config recipes/paper/model_configs/Qwen2.5-Coder-1.5B-Instruct   # a larger shape (random weights)
    ... [--path compiled|static|cuda-graphs] [--output PATH]   # default results/bench_decode[_quick].json
"""

import argparse
import functools
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trl_marl  # noqa: F401 (first: it filters a bitsandbytes notice that importing PEFT would print)

# isort: split
import peft
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from trl_marl import default_model_path
from trl_marl.agents import agent_lora_config, attach_agent_adapters
from trl_marl.generation.captured_decode import CapturedDecoder
from trl_marl.generation.decode_support import choose_path
from trl_marl.generation.routing import AdapterRouter
from trl_marl.precision import four_bit_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_info import run_header  # noqa: E402

# The arm timing the team's step without its LoRA matmuls grouped (`tensor_routing.py`), for the fusion's gain.
UNFUSED = "routed 4 agents, unfused"
PROMPT = "Name a colour, then a fruit, then a country, in one short sentence."


def load(precision: str, device: str, model_config: str | None = None):
    """The default model, or with `model_config` (a folder holding a `config.json`) a model of that shape with random
    weights (the decode step's cost does not depend on the weights' values), in `precision` on `device`."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision)
    source = default_model_path()
    if model_config is not None:  # saved once with random weights, then loaded as a checkpoint is (4-bit included)
        torch.manual_seed(0)
        source = tempfile.mkdtemp(prefix="bench-decode-")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config), dtype=torch.bfloat16)
        model.save_pretrained(source)
    kwargs = {"dtype": dtype}
    if precision == "4bit":
        kwargs = {"quantization_config": four_bit_config()}
    model = AutoModelForCausalLM.from_pretrained(source, device_map=device, **kwargs)
    if model_config is not None:
        shutil.rmtree(source)
    return model.eval()


def with_adapters(model, agents: int):
    names = [f"agent_{i}" for i in range(agents)]
    team = attach_agent_adapters(model, names, agent_lora_config(16, 32, 0.0, "all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in team.named_parameters():
            if "lora_B" in name:
                noise = torch.randn(parameter.shape, generator=generator) * 0.02
                parameter.copy_(noise.to(parameter.device, parameter.dtype))
    return team, names


def prompts(tokenizer, rows: int, device):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer([text] * rows, return_tensors="pt")
    # Rows of different lengths, left-padded, as a team's prompts are.
    for row in range(rows):
        cut = row % 4
        if cut:
            ids["input_ids"][row] = torch.cat(
                [torch.full((cut,), tokenizer.pad_token_id), ids["input_ids"][row, :-cut]]
            )
            ids["attention_mask"][row, :cut] = 0
    return ids["input_ids"].to(device), ids["attention_mask"].to(device)


def timed(generate, new_tokens: int, repeats: int) -> tuple[float, torch.Tensor]:
    best, output = float("inf"), None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = generate(new_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, output


def measure(model, decoder, router, adapters, input_ids, attention_mask, tokens: int, repeats: int) -> dict:
    def run(engine, new_tokens):
        if router is not None:
            router.route(adapters)
        try:
            kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
            with torch.no_grad():
                return engine(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            if router is not None:
                router.route(None)

    result = {}
    for label, engine in (("eager", model.generate), ("captured", decoder.generate)):
        start = time.perf_counter()
        run(engine, tokens)  # warm-up (the captured path compiles here)
        result[f"{label}_warmup_s"] = round(time.perf_counter() - start, 2)
        one, _ = timed(lambda n, e=engine: run(e, n), 1, repeats)
        many, output = timed(lambda n, e=engine: run(e, n), tokens, repeats)
        result[f"{label}_ms"] = round(1000 * (many - one) / (tokens - 1), 2)
        result[f"{label}_tokens"] = output
    # each shape's recording (or compiling) alone, as the decoder timed it; the warm-up call above includes it
    result["captured_shapes_s"] = {f"{rows}x{length}": round(s, 2) for (rows, length), s in decoder.warmups.items()}
    if decoder.failure:  # the captured step failed and fell back: these are eager figures twice
        result["captured_failure"] = decoder.failure
    eager_tokens, captured_tokens = result.pop("eager_tokens"), result.pop("captured_tokens")
    result["equal"] = torch.equal(eager_tokens, captured_tokens)
    result["equal_rows"] = sum(torch.equal(a, b) for a, b in zip(eager_tokens, captured_tokens))
    result["speedup"] = round(result["eager_ms"] / result["captured_ms"], 2)
    return result


def leave_ungrouped(router: AdapterRouter) -> bool:
    """In place of `AdapterRouter.fuse_shared_inputs`: the layers stay one to a group (the LoRA work unfused), and the
    routing stops noting each layer's input as it does until it is fused (a compiled step would trace that too)."""
    routing = router._tensor_routing
    routing.fused, routing._seen = True, None
    routing._build_forwards()
    return False


def team_over_base(rows: list[dict]) -> dict:
    """Per precision and row count, the captured step of 4 routed agents (fused and unfused) over the base's."""
    ratios = {}
    for row in rows:
        if row["model"] == "base":
            base = row["captured_ms"]
            key = f"{row['precision']} {row['rows']} rows"
        elif row["model"] in ("routed 4 agents", UNFUSED):
            ratios.setdefault(key, {})[row["model"]] = round(row["captured_ms"] / base, 2)
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16", "4bit"], default=None)
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per timed call (T)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--path", choices=["cuda-graphs", "compiled", "static"], default=None)
    parser.add_argument("--quick", action="store_true", help="a short check of the script: 8 rows, 8 tokens")
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--model_config", default=None, help="a folder with a config.json: time a model of that shape (random weights)"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows_list = args.rows or ([8] if args.quick else [16])
    precisions = args.precision or (["fp32"] if device == "cpu" else ["bf16", "4bit"])
    tokens = args.tokens or (8 if args.quick else 32)
    path = args.path or choose_path(True, torch.device(device))
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())

    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    summary = {
        **run_header(gpu=gpu, torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__),
        "path": path,
        "model": args.model_config or "SmolLM2-135M-Instruct",
        "tokens": tokens,
        "rows": [],
    }
    print(f"decode path {path} on {gpu or 'cpu'}; ms per decode step (T={tokens}), best of {args.repeats}")
    for precision in precisions:
        for rows in rows_list:
            for label, agents in (
                ("base", 0),
                ("one PEFT adapter", 1),
                ("routed 2 agents", 2),
                ("routed 4 agents", 4),
                (UNFUSED, 4),
            ):
                model = load(precision, device, args.model_config)
                router, adapters = None, None
                if agents:
                    model, names = with_adapters(model, agents)
                    adapters = [names[row % agents] for row in range(rows)]
                    if agents > 1:
                        router = AdapterRouter(model, names)
                    if label == UNFUSED:  # each LoRA layer its own A, mask and B, as before they were grouped
                        router.fuse_shared_inputs = functools.partial(leave_ungrouped, router)
                decoder = CapturedDecoder(model, router, path=path)
                input_ids, attention_mask = prompts(tokenizer, rows, model.device)
                figures = measure(model, decoder, router, adapters, input_ids, attention_mask, tokens, args.repeats)
                row = {"precision": precision, "rows": rows, "model": label, **figures}
                summary["rows"].append(row)
                print(
                    f"{precision:5} {rows:3} rows  {label:27} eager {figures['eager_ms']:8.2f} ms  "
                    f"captured {figures['captured_ms']:8.2f} ms  ({figures['speedup']}x, greedy equal: "
                    f"{figures['equal']}; warm-up {figures['captured_warmup_s']} s, recording or compiling "
                    f"{figures['captured_shapes_s']})",
                    flush=True,
                )
                del model, decoder, router
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
    summary["team_over_base"] = team_over_base(summary["rows"])
    for key, ratios in summary["team_over_base"].items():
        print(f"{key}: captured step of 4 routed agents / the base's: {ratios}")
    output = Path(
        args.output or Path(__file__).parent / "results" / f"bench_decode{'_quick' if args.quick else ''}.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
