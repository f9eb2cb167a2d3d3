"""Bad input gets a clear error naming what was wrong, or a documented, logged policy; nothing saved is lost."""

import asyncio
import time

import pytest
from datasets import Dataset

from trl_marl import MAGRPOConfig, MAGRPOTrainer, RewardFunctionError, Task, load_team
from trl_marl.trainers.checkpoints import COMPLETE_MARKER, last_complete_checkpoint


def make_config(output_dir, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        agents=["writer", "checker"],
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=4,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    settings.update(overrides)
    return MAGRPOConfig(**settings)


def prompts(*texts):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts]})


def length_reward(prompts, completions, **kwargs):
    return [float(len(c["writer"])) for c in completions]


def word_reward(prompts, completions, word, **kwargs):
    return [float(word in c["writer"]) for c in completions]


def test_a_reward_reading_a_column_the_data_lacks_fails_before_the_model_loads():
    with pytest.raises(ValueError, match=r"Team reward 'word_reward' reads the dataset column\(s\) \['word'\]"):
        MAGRPOTrainer("no/such-model", word_reward, args=make_config("unused"), train_dataset=prompts("Hi."))
    with_word = prompts("Hi.").add_column("word", ["hello"])
    with pytest.raises(ValueError, match=r"which the eval dataset lacks \(its columns: \['prompt'\]\)"):
        MAGRPOTrainer("no/such-model", word_reward, args=make_config("unused"), train_dataset=with_word,
                      eval_dataset=prompts("Hi."))  # fmt: skip


class NeedsTarget(Task):
    name = "needs_target"
    agents = [{"name": "writer"}, {"name": "checker"}]
    num_turns = 2
    reward_funcs = [length_reward]

    @staticmethod
    def _on_target(prompts, completions, target, **kwargs):
        return [float(str(target) in c) for c in completions]

    local_reward_funcs = {"checker": [_on_target]}

    def dataset(self, split="train"):
        return prompts("Count.")

    def transition(self, prompt, target, **kwargs):
        return [prompt, prompt]


def test_a_local_reward_or_transition_reading_a_missing_column_is_named():
    args = MAGRPOConfig.for_task(NeedsTarget(), output_dir="unused", use_cpu=True)
    with pytest.raises(ValueError, match=r"Local reward of agent 'checker' '_on_target' reads .*\['target'\]"):
        MAGRPOTrainer("no/such-model", args=args, task=NeedsTarget())
    NeedsTarget.local_reward_funcs = {}
    try:
        with pytest.raises(ValueError, match=r"Transition 'transition' reads the dataset column\(s\) \['target'\]"):
            MAGRPOTrainer("no/such-model", args=args, task=NeedsTarget())
    finally:
        NeedsTarget.local_reward_funcs = {"checker": [NeedsTarget._on_target]}


def slow_reward(prompts, completions, **kwargs):
    time.sleep(5)
    return [0.0] * len(prompts)


async def slow_async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(5)
    return [0.0] * len(prompts)


@pytest.mark.parametrize("reward", [slow_reward, slow_async_reward], ids=["sync", "async"])
def test_a_reward_slower_than_reward_timeout_is_an_error_naming_it(tiny_model_dir, tmp_path, reward):
    args = make_config(tmp_path, reward_timeout=0.5)
    trainer = MAGRPOTrainer(tiny_model_dir, reward, args=args, train_dataset=prompts("Hi.", "Yo."))
    started = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=rf"'{reward.__name__}' took longer than reward_timeout=0.5 s"):
        trainer.train()
    assert time.perf_counter() - started < 4.5  # it did not wait for the function


def test_reward_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"`reward_timeout` must be a positive number of seconds or None, got 0"):
        make_config("unused", reward_timeout=0)


def test_joint_actions_no_reward_scores_get_no_advantage_and_are_counted(tiny_model_dir, tmp_path):
    def declines_the_first(prompts, completions, **kwargs):  # None: "does not apply", as in TRL
        return [None if "first" in str(p) else float(len(c["writer"])) for p, c in zip(prompts, completions)]

    args = make_config(tmp_path, per_device_train_batch_size=4)
    trainer = MAGRPOTrainer(tiny_model_dir, declines_the_first, args=args, train_dataset=prompts("first", "second"))
    trainer.train()
    assert trainer.state.log_history[0]["frac_unscored"] == 0.5  # one of the two prompts, all of its joint actions


def test_a_prompt_longer_than_the_model_allows_names_the_agent(tiny_model_dir, tmp_path):
    long_prompt = "word " * 600  # the tiny model has 512 positions
    trainer = MAGRPOTrainer(tiny_model_dir, length_reward, args=make_config(tmp_path),
                            train_dataset=prompts(long_prompt, long_prompt))  # fmt: skip
    expected = (
        r"Agent 'writer' got a prompt of \d+ tokens; with max_completion_length=4 it exceeds the model's 512 "
        r"positions.*word word \\nassistant\\n'\. Filter out such rows"
    )
    with pytest.raises(ValueError, match=expected):
        trainer.train()


def test_an_error_mid_training_leaves_the_last_checkpoint_complete_and_resumable(tiny_model_dir, tmp_path):
    def fails_at_step_2(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            raise RuntimeError("the judge is down")
        return [float(len(c["writer"])) for c in completions]

    settings = dict(max_steps=3, save_strategy="steps", save_steps=1)
    trainer = MAGRPOTrainer(tiny_model_dir, fails_at_step_2, args=make_config(tmp_path, **settings),
                            train_dataset=prompts("Hi.", "Yo."))  # fmt: skip
    with pytest.raises(RewardFunctionError, match="'fails_at_step_2' raised RuntimeError: the judge is down"):
        trainer.train()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")
    assert (tmp_path / "checkpoint-1" / COMPLETE_MARKER).is_file() and load_team(tmp_path / "checkpoint-1")
    resumed = MAGRPOTrainer(tiny_model_dir, length_reward, args=make_config(tmp_path, **settings),
                            train_dataset=prompts("Hi.", "Yo."))  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
