"""Requests/s and tokens/s of a team behind `trl-marl serve`, at 1, 4, 8 and 16 concurrent clients (agents mixed),
against the same requests made one after the other through `Team` directly.

A two-agent team on the embedded SmolLM2-135M-Instruct (saved untrained unless `--team` names one) is served by
`python -m trl_marl.cli serve TEAM --port 0` in a subprocess; the clients are the official `openai` client
(`AsyncOpenAI`), all greedy, each asking for at most `--tokens` new tokens. Every request is also made alone through
the loaded `Team`'s own generation path (the routed `generate` call of one turn, one row), one after another.

Printed per concurrency `c`: the wall time of `c` requests sent at once (median over `--rounds`), requests/s,
completion tokens/s, and that time over one request's. The targets (docs/serving.md): 8 concurrent clients finish in
at most 2x the time of one request, and one client's request costs at most 1.2x a direct `Team` call.

    python recipes/benchmarks/bench_serve.py                 # ~3 min on 2 idle CPU cores; --tokens, --rounds, --out

With `--long N`, one long answer instead: N tokens (the base's end-of-sequence tokens suppressed in its generation
config, so that a greedy answer runs to `max_tokens`), asked for unstreamed and streamed, each without and with a stop
string that never appears; printed: the seconds of each (median over `--rounds`) and that over the unstreamed answer's.
Streaming and stop strings cost the server the text of every token: this shows whether that cost grows with the answer.
`--tiny` serves a tiny randomly initialised Llama with the default model's tokenizer (as the tests build one) instead
of the default model, whose generation costs little beside that text.

    python recipes/benchmarks/bench_serve.py --long 5000 --tiny --rounds 1   # ~2 min on 2 idle CPU cores

With `--grammar`, the cost of constrained decoding: the same 8 requests sent at once, greedy, with no response format
and with a `json_schema` one (an object of a title and a story of at least 400 characters, so that every answer runs
to `--tokens` in both arms),
`--rounds` times each, alternating; printed: completion tokens/s of each (median) and their ratio. The target
(docs/benchmarks.md): tokens/s with the grammar at least 0.8x without.

    python recipes/benchmarks/bench_serve.py --grammar --rounds 3          # ~4 min on 2 idle CPU cores
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

import torch
from datasets import Dataset

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path, load_team
from trl_marl.agents import agent_prompt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_info import run_header  # noqa: E402

AGENTS = [
    {"name": "writer", "system_prompt": "You write short, vivid stories."},
    {"name": "critic", "system_prompt": "You review stories and suggest improvements."},
]
QUESTIONS = [
    "Tell a story about a lighthouse keeper.",
    "Describe a storm over the sea.",
    "Write about a robot learning to paint.",
    "Tell a story about a lost cat finding home.",
    "Describe a market on a rainy morning.",
    "Write about a dragon who fears heights.",
    "Tell a story about two friends building a boat.",
    "Describe a city at midnight.",
]
CONCURRENCY = (1, 4, 8, 16)


def no_reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


STOP_NEVER_SEEN = "@@no such text@@"


def save_team(folder: str, model: str | None = None) -> str:
    args = MAGRPOConfig(output_dir=folder, agents=AGENTS, num_turns=1, report_to="none", use_cpu=True, bf16=False)
    MAGRPOTrainer(
        model or default_model_path(), no_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["Hi."]})
    ).save_model()
    return folder


def tiny_base(folder: str, positions: int) -> str:
    """A tiny randomly initialised Llama with the default model's tokenizer and chat template (as `tests/conftest.py`
    builds one), `positions` tokens long, written to `folder`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def endless_base(source: str, folder: str) -> str:
    """The model at `source` again in `folder` (its files linked), its generation config suppressing its
    end-of-sequence tokens: a greedy answer runs to its `max_tokens`."""
    from transformers import AutoTokenizer, GenerationConfig

    os.makedirs(folder)
    for name in os.listdir(source):
        if name != "generation_config.json":
            os.symlink(os.path.join(source, name), os.path.join(folder, name))
    config = GenerationConfig.from_pretrained(source)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    config.suppress_tokens = sorted(
        {*[token for token in eos if token is not None], AutoTokenizer.from_pretrained(source).eos_token_id}
    )
    config.save_pretrained(folder)
    return folder


def requests_for(count: int, start: int = 0) -> list[tuple[int, list[dict]]]:
    """`count` (agent index, messages) requests, the agents alternating."""
    return [
        (index % len(AGENTS), [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}])
        for index in range(start, start + count)
    ]


def direct_seconds(team, requests, tokens: int) -> tuple[float, int]:
    """Each request alone through `Team`'s generation path (one turn's routed call, one row): total seconds, tokens."""
    total, generated = 0.0, 0
    for agent, messages in requests:
        conversation = agent_prompt(team.agents[agent]["system_prompt"], messages, use_chat_template=True)
        begin = time.perf_counter()
        _, completions, _ = team._generate([conversation], [agent], tokens, False)
        total += time.perf_counter() - begin
        generated += len(completions[0])
    return total, generated


async def served_round(base_url: str, requests, tokens: int) -> tuple[float, int]:
    """`requests` sent at once by as many clients: wall seconds until the last answer, completion tokens."""
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0) for _ in requests]
    begin = time.perf_counter()
    answers = await asyncio.gather(
        *[
            client.chat.completions.create(
                model=AGENTS[agent]["name"], messages=messages, temperature=0, max_tokens=tokens
            )
            for client, (agent, messages) in zip(clients, requests)
        ]
    )
    seconds = time.perf_counter() - begin
    for client in clients:
        await client.close()
    return seconds, sum(answer.usage.completion_tokens for answer in answers)


# The story at least 400 characters long: every answer runs to `max_tokens` in both arms (the same work).
STORY = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 400}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


async def formatted_round(base_url: str, requests, tokens: int, response_format: dict | None) -> tuple[float, int]:
    """`requests` sent at once, with `response_format` (or none): wall seconds, completion tokens."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    options = {"response_format": response_format} if response_format else {}
    begin = time.perf_counter()
    answers = await asyncio.gather(
        *[
            client.chat.completions.create(
                model=AGENTS[agent]["name"], messages=messages, temperature=0, max_tokens=tokens, **options
            )
            for agent, messages in requests
        ]
    )
    seconds = time.perf_counter() - begin
    await client.close()
    return seconds, sum(answer.usage.completion_tokens for answer in answers)


def grammar_cost(args) -> dict:
    """`--grammar`: completion tokens/s of 8 concurrent requests without and with a `json_schema` format."""
    story = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY, "strict": True}}
    arms = {"text": None, "json_schema": story}
    rounds = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as folder:
        team_dir = args.team or save_team(folder)
        process, base_url = start_server(team_dir, args.max_batch_rows, args.chunk_tokens)
        try:
            requests = requests_for(8)
            for response_format in arms.values():  # warm-up: the grammar's tokenizer is built at its first request
                asyncio.run(formatted_round(base_url, requests[:1], 8, response_format))
            for _ in range(args.rounds):
                for name, response_format in arms.items():
                    rounds[name].append(asyncio.run(formatted_round(base_url, requests, args.tokens, response_format)))
        finally:
            process.terminate()
            process.wait(30)
    figures = {
        name: {
            "tokens_per_second": statistics.median(tokens / seconds for seconds, tokens in results),
            "completion_tokens": [tokens for _, tokens in results],
            "seconds": [seconds for seconds, _ in results],
        }
        for name, results in rounds.items()
    }
    ratio = figures["json_schema"]["tokens_per_second"] / figures["text"]["tokens_per_second"]
    print(f"torch threads: {torch.get_num_threads()}; 8 requests at once, greedy, at most {args.tokens} tokens each")
    for name, entry in figures.items():
        print(f"{name:>12}: {entry['tokens_per_second']:.1f} completion tokens/s (median of {args.rounds})")
    print(f"json_schema / text tokens/s: {ratio:.2f} (target >= 0.8)")
    return {"grammar": True, "tokens": args.tokens, "rounds": args.rounds, "arms": figures, "ratio": ratio}


async def long_answer(base_url: str, tokens: int, stream: bool, stop: str | None) -> tuple[float, int, str]:
    """One greedy answer of at most `tokens` tokens, streamed or not: wall seconds, completion tokens, its text."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600)
    options = {"stop": [stop]} if stop else {}
    if stream:
        options["stream_options"] = {"include_usage": True}
    begin = time.perf_counter()
    messages = requests_for(1)[0][1]
    answer = await client.chat.completions.create(
        model=AGENTS[0]["name"], messages=messages, temperature=0, max_tokens=tokens, stream=stream, **options
    )
    if stream:
        pieces, completion_tokens = [], 0
        async for chunk in answer:
            pieces += [choice.delta.content or "" for choice in chunk.choices]
            completion_tokens = chunk.usage.completion_tokens if chunk.usage else completion_tokens
        text = "".join(pieces)
    else:
        text, completion_tokens = answer.choices[0].message.content, answer.usage.completion_tokens
    seconds = time.perf_counter() - begin
    await client.close()
    return seconds, completion_tokens, text


def long_answers(args) -> dict:
    """`--long`: the seconds of one long answer, unstreamed and streamed, without and with a stop string."""
    variants = {}
    with tempfile.TemporaryDirectory() as folder:
        source = tiny_base(os.path.join(folder, "tiny"), args.long + 512) if args.tiny else default_model_path()
        team_dir = save_team(os.path.join(folder, "team"), source)
        base = endless_base(source, os.path.join(folder, "endless"))
        process, base_url = start_server(team_dir, args.max_batch_rows, args.chunk_tokens, ("--base_model", base))
        try:
            asyncio.run(long_answer(base_url, 16, True, STOP_NEVER_SEEN))  # warm-up
            texts = set()
            for stream in (False, True):
                for stop in (None, STOP_NEVER_SEEN):
                    rounds = [asyncio.run(long_answer(base_url, args.long, stream, stop)) for _ in range(args.rounds)]
                    name = ("streamed" if stream else "unstreamed") + (" + stop string" if stop else "")
                    variants[name] = {
                        "seconds": statistics.median(seconds for seconds, _, _ in rounds),
                        "completion_tokens": rounds[0][1],
                    }
                    texts.update(text for _, _, text in rounds)
        finally:
            process.terminate()
            process.wait(30)
    if len(texts) != 1:
        raise RuntimeError("The long answers differ between rounds or variants: greedy answers should not.")
    unstreamed = variants["unstreamed"]["seconds"]
    print(
        f"torch threads: {torch.get_num_threads()}; one greedy answer of at most {args.long} tokens (EOS suppressed)"
    )
    print(f"base: {'a tiny random Llama' if args.tiny else 'the default model'}, rounds: {args.rounds}")
    print(f"{'answer':>26}  {'tokens':>6}  {'seconds':>8}  {'x unstreamed':>12}")
    for name, figures in variants.items():
        print(
            f"{name:>26}  {figures['completion_tokens']:>6}  {figures['seconds']:>8.2f}  "
            f"{figures['seconds'] / unstreamed:>12.2f}"
        )
    return {"long": args.long, "tiny": args.tiny, "rounds": args.rounds, "answers": variants}


def start_server(
    team_dir: str, max_batch_rows: int, chunk_tokens: int, options: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "trl_marl.cli", "serve", team_dir, "--port", "0", *options]
    command += ["--max_batch_rows", str(max_batch_rows), "--chunk_tokens", str(chunk_tokens)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    if " at http" not in line:
        process.terminate()
        raise RuntimeError(f"The server did not start: it printed {line!r}")
    return process, line.rsplit(" at ", 1)[1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--team", default=None, help="a saved team (default: an untrained one on the default model)")
    parser.add_argument("--tokens", type=int, default=64, help="max new tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency (the median is reported)")
    parser.add_argument("--max_batch_rows", type=int, default=16)
    parser.add_argument("--chunk_tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--long", type=int, default=None, help="time one answer of this many tokens, streamed or not")
    parser.add_argument("--tiny", action="store_true", help="with --long: a tiny random model, not the default one")
    parser.add_argument("--grammar", action="store_true", help="tokens/s with a json_schema format against without")
    args = parser.parse_args()
    if args.long or args.grammar:
        summary = long_answers(args) if args.long else grammar_cost(args)
        if args.out:
            with open(args.out, "w") as file:
                json.dump({**run_header(torch_threads=torch.get_num_threads()), **summary}, file, indent=2)
        return

    with tempfile.TemporaryDirectory() as folder:
        team_dir = args.team or save_team(folder)
        team = load_team(team_dir)
        all_requests = requests_for(max(CONCURRENCY))
        direct_total, direct_tokens = direct_seconds(team, all_requests[:1], args.tokens)  # warm-up
        direct_total, direct_tokens = direct_seconds(team, all_requests, args.tokens)
        direct_one = direct_seconds(team, all_requests[:1], args.tokens)[0]
        team.close()
        del team

        process, base_url = start_server(team_dir, args.max_batch_rows, args.chunk_tokens)
        try:
            asyncio.run(served_round(base_url, all_requests[:1], args.tokens))  # warm-up
            served = {}
            for concurrency in CONCURRENCY:
                rounds = [
                    asyncio.run(served_round(base_url, all_requests[:concurrency], args.tokens))
                    for _ in range(args.rounds)
                ]
                seconds = statistics.median(wall for wall, _ in rounds)
                served[concurrency] = {"seconds": seconds, "completion_tokens": rounds[0][1]}
        finally:
            process.terminate()
            process.wait(30)

    one = served[1]["seconds"]
    print(f"torch threads: {torch.get_num_threads()}; max {args.tokens} new tokens per request, greedy")
    print(
        f"direct Team, one after another: {len(all_requests)} requests in {direct_total:.2f} s "
        f"({len(all_requests) / direct_total:.2f} req/s, {direct_tokens / direct_total:.1f} tok/s); "
        f"one request {direct_one:.2f} s"
    )
    print(f"{'clients':>7}  {'seconds':>8}  {'req/s':>6}  {'tok/s':>7}  {'x one request':>13}")
    for concurrency, figures in served.items():
        seconds = figures["seconds"]
        print(
            f"{concurrency:>7}  {seconds:>8.2f}  {concurrency / seconds:>6.2f}  "
            f"{figures['completion_tokens'] / seconds:>7.1f}  {seconds / one:>13.2f}"
        )
    print(f"one served request / one direct Team call: {one / direct_one:.2f} (target <= 1.2)")
    print(f"8 concurrent clients / one request: {served[8]['seconds'] / one:.2f} (target <= 2)")
    if args.out:
        summary = {
            **run_header(torch_threads=torch.get_num_threads()),
            "tokens": args.tokens,
            "direct": {"requests": len(all_requests), "seconds": direct_total, "tokens": direct_tokens},
            "direct_one_seconds": direct_one,
            "served": served,
        }
        with open(args.out, "w") as file:
            json.dump(summary, file, indent=2)


if __name__ == "__main__":
    main()
