"""Trains a two-agent team for 5 steps with a checkpoint every step (tests/test_resume.py).

train_until_killed.py MODEL OUTPUT_DIR --kill_while_saving N   the process SIGKILLs itself while writing
                                                                checkpoint-N (after its weights, before its
                                                                optimizer state)
train_until_killed.py MODEL OUTPUT_DIR --resume                 resumes from the latest complete checkpoint and
                                                                prints {"resumed_from", "global_step"} as JSON
"""

import argparse
import json
import os
import signal

from datasets import Dataset
from transformers import Trainer

from trl_marl import MAGRPOConfig, MAGRPOTrainer
from trl_marl.trainers.checkpoints import last_complete_checkpoint


def team_reward(prompts, completions, **kwargs):
    return [len(c["detailed"]) / (1 + len(c["concise"])) for c in completions]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("output_dir")
    parser.add_argument("--kill_while_saving", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    arguments = parser.parse_args()

    if arguments.kill_while_saving is not None:
        save_optimizer = Trainer._save_optimizer_and_scheduler

        def save_or_die(trainer, output_dir):
            if trainer.state.global_step == arguments.kill_while_saving:
                os.kill(os.getpid(), signal.SIGKILL)
            save_optimizer(trainer, output_dir)

        Trainer._save_optimizer_and_scheduler = save_or_die

    args = MAGRPOConfig(
        output_dir=arguments.output_dir,
        agents=["concise", "detailed"],
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=4,
        learning_rate=1e-2,
        max_steps=5,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        use_cpu=True,
    )
    dataset = Dataset.from_dict({"prompt": ["Name a colour.", "Name a fruit.", "Say hello.", "Count to two."]})
    trainer = MAGRPOTrainer(arguments.model, team_reward, args=args, train_dataset=dataset)
    resumed_from = last_complete_checkpoint(arguments.output_dir) if arguments.resume else None
    trainer.train(resume_from_checkpoint=True if arguments.resume else None)
    print(json.dumps({"resumed_from": resumed_from, "global_step": trainer.state.global_step}))


if __name__ == "__main__":
    main()
