"""Multi-turn MAGRPO: a two-agent team that answers, gets external feedback, and answers again; then the saved team
is loaded with `trl_marl.load_team` and plays a new prompt.

The task: describe a word in at most `--word_limit` words. Both agents answer at turn 1; between turns a checker (the
transition) tells each agent, privately, what was wrong with *its own* answer (too many words, the word itself); at
turn 2 each agent answers again, shown that feedback and, by the `parallel` scheduler, both answers of turn 1.
The team reward of a joint action is the share of agents whose answer is non-empty, within the limit and free of
the word itself (describe, don't repeat). Returns are Monte-Carlo over the tree (`--discount`), so a turn-1 answer
is also credited for what it led to.

    python recipes/magrpo_multiturn.py                        # defaults below, ~16 min on 2 CPU cores
    python recipes/magrpo_multiturn.py --num_turns 3 --max_steps 30 --output_dir outputs/mt

Every `MAGRPOConfig` / `GRPOConfig` field is a command-line flag. Prints the team reward per turn on held-out words
before and after training, then one episode of the reloaded team; writes `<output_dir>/results.json`.
"""

import json
import os
import random
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path, load_team
from trl_marl.memory import peak_memory
from trl_marl.tasks.toy import (  # the `describe_word` task
    DESCRIBE_AGENTS,
    WORDS,
    brief_description_reward,
    word_count_feedback,
    word_dataset,
)

AGENTS = DESCRIBE_AGENTS


@dataclass
class MultiturnArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    word_limit: int = field(default=8, metadata={"help": "Most words an answer may have."})
    eval_words: int = field(default=6, metadata={"help": "Held-out words for the before/after reward."})


def turn_rewards(metrics: dict, num_turns: int) -> list[float]:
    return [metrics[f"eval_turns/{t}/reward"] if num_turns > 1 else metrics["eval_reward"] for t in range(num_turns)]


def main() -> None:
    parser = TrlParser((MultiturnArguments, MAGRPOConfig))
    on_gpu = torch.cuda.is_available()
    parser.set_defaults(
        output_dir="outputs/magrpo-multiturn",
        agents=AGENTS,
        num_turns=2,
        discount=0.9,
        num_generations=2,  # per node: 2 completions per agent; the tree of one prompt has 2 + 4 joint actions
        # Two words per step: 4 prompt copies, generated at once, whose trees give 8 root rows and 16 child rows. The
        # CPU trains them in 4 micro-batches (a peak of about 13.6 GiB in one); the same update with TRL's default
        # `loss_type` (docs/multiturn.md pads the tree's rows so that each weighs what it would in one batch). A GPU
        # trains them in one, with gradient checkpointing.
        per_device_train_batch_size=4 if on_gpu else 1,
        gradient_accumulation_steps=1 if on_gpu else 4,
        per_device_eval_batch_size=4,
        num_generations_eval=2,
        max_completion_length=24,
        max_steps=16,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        lora_r=16,
        lora_alpha=32,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
        gradient_checkpointing=on_gpu,
    )
    script_args, args = parser.parse_args_and_config()

    words = list(WORDS)
    random.Random(args.seed).shuffle(words)
    eval_dataset = word_dataset(words[: script_args.eval_words], script_args.word_limit)
    train_dataset = word_dataset(words[script_args.eval_words :], script_args.word_limit)
    model = script_args.model_name_or_path or default_model_path()
    trainer = MAGRPOTrainer(
        model,
        brief_description_reward,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        transition=word_count_feedback,
    )

    start = time.perf_counter()
    before = turn_rewards(trainer.evaluate(), args.num_turns)
    print(f"Team reward per turn before training: {[round(r, 3) for r in before]}", flush=True)
    trainer.train()
    after = turn_rewards(trainer.evaluate(), args.num_turns)
    print(f"Team reward per turn after {trainer.state.global_step} steps: {[round(r, 3) for r in after]}", flush=True)
    trainer.save_model(args.output_dir)

    # The saved team, rebuilt from disk, plays a word it never saw.
    team = load_team(args.output_dir)
    new_word = "telescope"
    episode = team.run(
        word_dataset([new_word], script_args.word_limit)[0]["prompt"], word=new_word, word_limit=script_args.word_limit
    )
    for turn, answers in enumerate(episode.turns):
        for agent, text in answers.items():
            print(f"turn {turn + 1} [{agent}] {text.strip()}")
    minutes = (time.perf_counter() - start) / 60
    results = {
        "team_reward_per_turn_before": before,
        "team_reward_per_turn_after": after,
        "steps": trainer.state.global_step,
        "minutes": minutes,
        "team": args.output_dir,
        "episode": {"word": new_word, "turns": episode.turns},
    }
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(
        f"Team saved in {args.output_dir} (load it with trl_marl.load_team); results.json written ({minutes:.1f} min)"
    )


if __name__ == "__main__":
    main()
