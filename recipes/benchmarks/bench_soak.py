"""Soak: does memory stay flat over a long run? Resident memory sampled through long training runs and a long serving
run, and its growth from the first quarter to the last.

Three parts, each in its own process, one after the other (never two at once):

- `train --recipe quickstart`: `recipes/magrpo_quickstart.py`'s team and settings, `--steps` training steps;
- `train --recipe tool_team`: `recipes/tool_team.py`'s team, program and settings (a program calling a tool through the
  trainer's own endpoint), `--steps` steps;
- `serve`: a two-agent team on the embedded model behind `trl-marl serve`, `--clients` clients sending for
  `--minutes` minutes a mix of requests, in turn: plain, streamed, with a tool (`tool_choice` auto and required), with
  a `json_schema` response format, a stream the client drops after its first chunk, and refused bodies (an unknown
  model, a field of the wrong type: a 4xx expected).

Training: after every step (`on_step_end`: the optimizer step done, the gradients zeroed) a callback reads the
process's resident set (`VmRSS`) and its peak since the step before (`VmHWM`, reset after each read through
`/proc/self/clear_refs`). Step 1 allocates what every later step reuses, so the quarters are taken over steps 2..N:
growth = mean of the last quarter / mean of the first quarter - 1, for the steps' peaks and for the floors after them.
Serving: the server process's `VmRSS` every `--sample_seconds`; the quarters over the samples after `--warmup_minutes`.
Also counted: answers per kind, server errors (5xx, a dropped connection the client did not ask for, an error event or
a stream without its end) and lost requests (sent, never answered: the client's timeout, 600 s). The targets
(docs/benchmarks.md): growth within 5 %, no server error, nothing lost.

    python recipes/benchmarks/bench_soak.py train --recipe quickstart --steps 30    # ~17 min on 2 idle CPU cores
    python recipes/benchmarks/bench_soak.py train --recipe tool_team --steps 30     # ~45 min
    python recipes/benchmarks/bench_soak.py serve --minutes 20 --clients 8          # 20 min

Each writes its figures to `--out` (default results/bench_soak_<part>.json).
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from run_info import run_header  # noqa: E402

from trl_marl.memory.measured import GIB, reset_peak_resident, status_bytes  # noqa: E402


def growth(values: list[float]) -> dict | None:
    """Mean of the first and last quarters of `values`, and the last over the first minus 1 (None without values)."""
    if not values:
        return None
    quarter = max(1, len(values) // 4)
    first, last = statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])
    return {"first_quarter": first, "last_quarter": last, "growth": last / first - 1}


def described(figures: dict | None) -> str:
    if figures is None:
        return "no samples"
    return (
        f"first quarter {figures['first_quarter']:.2f} GiB, last quarter {figures['last_quarter']:.2f} GiB, growth "
        f"{100 * figures['growth']:+.1f} %"
    )


# -- training


def recipe_trainer(recipe: str, steps: int, output_dir: str, model: str | None = None, **overrides):
    """The recipe's trainer, built as its `main` builds it, for `steps` steps (no evaluation, nothing saved), on
    `model` (default: the embedded one), with `overrides` of its `MAGRPOConfig` settings."""
    import tool_team
    import torch
    from magrpo_quickstart import quickstart_datasets, quickstart_defaults

    from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
    from trl_marl.tasks.toy import explain_ratio_reward

    on_gpu = torch.cuda.is_available()
    defaults = tool_team.tool_team_defaults(on_gpu) if recipe == "tool_team" else quickstart_defaults(on_gpu)
    args = MAGRPOConfig(**{**defaults, "output_dir": output_dir, "logging_steps": 1, "max_steps": steps, **overrides})
    model = model or default_model_path()
    if recipe == "quickstart":
        train_dataset, _ = quickstart_datasets(args.seed, 12)
        return MAGRPOTrainer(model, explain_ratio_reward, args=args, train_dataset=train_dataset)
    questions = tool_team.sum_questions(12 + 256, args.seed)
    train_dataset = questions.select(range(12, len(questions)))
    return MAGRPOTrainer(model, args=args, train_dataset=train_dataset, episode=tool_team.calculate_then_answer)


def soak_training(args) -> dict:
    from transformers import TrainerCallback

    class ResidentPerStep(TrainerCallback):
        def __init__(self):
            self.peaks, self.floors, self.seconds = [], [], []
            self.started = time.perf_counter()

        def on_train_begin(self, *unused, **kwargs):
            reset_peak_resident()

        def on_step_end(self, *unused, **kwargs):
            self.peaks.append(status_bytes("VmHWM") / GIB)
            self.floors.append(status_bytes("VmRSS") / GIB)
            self.seconds.append(time.perf_counter() - self.started)
            reset_peak_resident()

    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(args.recipe, args.steps, folder)
        resident = ResidentPerStep()
        trainer.add_callback(resident)
        trainer.train()
    later_peaks, later_floors = resident.peaks[1:], resident.floors[1:]
    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "peak_gib_per_step": resident.peaks,
        "floor_gib_per_step": resident.floors,
        "seconds_at_step_end": resident.seconds,
        "peak": growth(later_peaks),
        "floor": growth(later_floors),
        "highest_peak_gib": max(resident.peaks),
    }
    print(f"{args.recipe}, {args.steps} steps: peak per step (GiB) {[round(p, 2) for p in resident.peaks]}")
    print(f"floor after each step (GiB) {[round(f, 2) for f in resident.floors]}")
    for name in ("peak", "floor"):
        print(f"{name}, steps 2..{args.steps}: {described(result[name])}")
    return result


# -- serving

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
            "required": ["answer", "sure"],
        },
        "strict": True,
    },
}
KINDS = ("plain", "streamed", "tool_auto", "tool_required", "json_schema", "dropped_stream", "refused")
QUESTIONS = ["What is the capital of France?", "Name a colour of the sky.", "What is 3 plus 4?", "Say hello."]


async def one_request(client, http, base_url: str, kind: str, index: int, tokens: int) -> str:
    """Send one request of `kind`; the outcome: "ok", "expected_4xx", "unexpected_4xx", "server_error" or "lost"."""
    import httpx
    import openai

    model = ("writer", "critic")[index % 2]
    messages = [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]
    options = dict(model=model, messages=messages, max_tokens=tokens)
    try:
        if kind == "plain":
            await client.chat.completions.create(**options)
        elif kind == "streamed":
            stream = await client.chat.completions.create(**options, stream=True)
            finished = False
            async for chunk in stream:
                finished = finished or any(choice.finish_reason for choice in chunk.choices)
            if not finished:
                return "server_error"  # a stream that ended without its last chunk
        elif kind == "tool_auto":
            await client.chat.completions.create(**options, tools=[WEATHER], tool_choice="auto")
        elif kind == "tool_required":
            await client.chat.completions.create(**options, tools=[WEATHER], tool_choice="required")
        elif kind == "json_schema":
            await client.chat.completions.create(**options, response_format=ANSWER)
        elif kind == "dropped_stream":
            stream = await client.chat.completions.create(**options, stream=True)
            async for _ in stream:
                break
            await stream.close()  # the client goes away mid-answer
        elif kind == "refused":
            body = {**options, "model": "nobody"} if index % 2 else {**options, "max_tokens": "many"}
            try:
                response = await http.post(f"{base_url}/chat/completions", json=body)
            except httpx.TimeoutException:
                return "lost"
            except httpx.HTTPError:
                return "server_error"  # the connection dropped, or the answer was not HTTP
            return "expected_4xx" if 400 <= response.status_code < 500 else "server_error"
        return "ok"
    except openai.APIStatusError as error:
        return "server_error" if error.status_code >= 500 else "unexpected_4xx"
    except openai.APITimeoutError:
        return "lost"  # sent, never answered
    except (openai.APIConnectionError, openai.APIError):
        return "server_error"  # a dropped connection the client did not ask for, or an error event mid-stream


async def clients_loop(base_url: str, api_key: str, clients: int, seconds: float, tokens: int) -> dict:
    import httpx
    from openai import AsyncOpenAI

    outcomes = {kind: {} for kind in KINDS}
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {api_key}"}

    async def client_task(number: int) -> None:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
        async with httpx.AsyncClient(headers=headers, timeout=600) as http:
            index = number
            while time.monotonic() < deadline:
                kind = KINDS[index % len(KINDS)]
                outcome = await one_request(client, http, base_url, kind, index, tokens)
                outcomes[kind][outcome] = outcomes[kind].get(outcome, 0) + 1
                index += clients
        await client.close()

    await asyncio.gather(*[client_task(number) for number in range(clients)])
    return outcomes


def soak_serving(args) -> dict:
    import threading

    from bench_serve import save_team, start_server

    with tempfile.TemporaryDirectory() as folder:
        team_dir = save_team(os.path.join(folder, "team"))
        process, base_url = start_server(team_dir, 64, 16)
        samples = []
        stop = threading.Event()

        def sample() -> None:
            started = time.monotonic()
            while not stop.wait(args.sample_seconds):
                try:
                    samples.append((time.monotonic() - started, status_bytes("VmRSS", process.pid) / GIB))
                except (OSError, StopIteration):
                    return  # the server is gone: `server_exit_code_before_stop` says so

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            outcomes = asyncio.run(clients_loop(base_url, "bench", args.clients, 60 * args.minutes, args.tokens))
        finally:
            stop.set()
            sampler.join()
            exit_code = process.poll()  # None: the server was still serving when the clients stopped
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
    after_warmup = [rss for at, rss in samples if at >= 60 * args.warmup_minutes]
    counts = {outcome: sum(kind.get(outcome, 0) for kind in outcomes.values()) for outcome in
              ("ok", "expected_4xx", "unexpected_4xx", "server_error", "lost")}  # fmt: skip
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "max_tokens": args.tokens,
        "outcomes": outcomes,
        "counts": counts,
        "rss_gib_samples": samples,
        "rss": growth(after_warmup),
        "highest_rss_gib": max((rss for _, rss in samples), default=None),
        "server_exit_code_before_stop": exit_code,
    }
    print(f"{args.clients} clients, {args.minutes} min: {counts}")
    highest = result["highest_rss_gib"]
    print(f"server RSS after {args.warmup_minutes} min: {described(result['rss'])}; highest {highest} GiB")
    if exit_code is not None:
        print(f"The server had exited (code {exit_code}) before the clients stopped.")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    train = parts.add_parser("train")
    train.add_argument("--recipe", choices=("quickstart", "tool_team"), required=True)
    train.add_argument("--steps", type=int, default=30)
    serve = parts.add_parser("serve")
    serve.add_argument("--minutes", type=float, default=20)
    serve.add_argument("--warmup_minutes", type=float, default=1)
    serve.add_argument("--clients", type=int, default=8)
    serve.add_argument("--tokens", type=int, default=24, help="max_tokens of every request")
    serve.add_argument("--sample_seconds", type=float, default=5)
    for part in (train, serve):
        part.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = soak_training(args) if args.part == "train" else soak_serving(args)
    name = f"{args.part}_{args.recipe}" if args.part == "train" else args.part
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"bench_soak_{name}.json")
    with open(out, "w") as file:
        json.dump({**run_header(), **result}, file, indent=2)
    print(f"Written: {out}")


if __name__ == "__main__":
    main()
