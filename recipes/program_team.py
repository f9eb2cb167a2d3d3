"""Train a team from an agent program: two agents called with the plain `openai` client, on the CPU, in minutes.

The program is the rollout. For each question the `concise` agent answers, then the `detailed` agent is shown the
question and that answer and explains it: two chat-completion calls through the `openai` client the trainer hands
each episode (bound to the trainer's own endpoint, docs/programs.md). The program returns both answers, and the
`explain` task's team reward scores them: the explanation must be at least three times as long (in words) as the
answer, so neither agent can earn it alone. Four episodes per question form MAGRPO's group.

    python recipes/program_team.py                           # defaults below
    python recipes/program_team.py --max_steps 30 --output_dir outputs/program

Every `MAGRPOConfig` / `GRPOConfig` field is a command-line flag. Prints the team reward on held-out questions (the
same program, evaluation mode) before and after training and where the agents' adapters were saved; writes the same
to `<output_dir>/results.json`. The saved team is what `load_team` and `trl-marl serve` take.
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.tasks.toy import EXPLAIN_AGENTS, explain_ratio_reward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from magrpo_quickstart import quickstart_datasets, quickstart_defaults, train_and_report  # noqa: E402


def answer_then_explain(client, row) -> dict[str, str]:
    """One episode: `concise` answers the question, `detailed` explains that answer."""
    question = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"]
    answer = client.chat.completions.create(model="concise", messages=[{"role": "user", "content": question}])
    short = answer.choices[0].message.content
    shown = f"{question}\nThe short answer: {short}\nExplain it."
    explanation = client.chat.completions.create(model="detailed", messages=[{"role": "user", "content": shown}])
    return {"concise": short, "detailed": explanation.choices[0].message.content}


@dataclass
class ProgramArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_questions: int = field(default=12, metadata={"help": "Held-out questions for the before/after reward."})


def main() -> None:
    parser = TrlParser((ProgramArguments, MAGRPOConfig))
    parser.set_defaults(**{**quickstart_defaults(torch.cuda.is_available()), "output_dir": "outputs/program-team"})
    script_args, args = parser.parse_args_and_config()
    assert [agent["name"] for agent in args.agents] == [agent["name"] for agent in EXPLAIN_AGENTS]

    train_dataset, eval_dataset = quickstart_datasets(args.seed, script_args.eval_questions)
    model = script_args.model_name_or_path or default_model_path()
    trainer = MAGRPOTrainer(
        model,
        explain_ratio_reward,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        episode=answer_then_explain,
    )

    train_and_report(trainer, args.output_dir, len(eval_dataset))  # train() and evaluate() each stop their server


if __name__ == "__main__":
    main()
