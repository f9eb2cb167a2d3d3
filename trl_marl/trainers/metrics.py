"""The team's metrics, logged through TRL's `_metrics` / `_logs` buffers: over joint actions, per agent, per turn."""

import torch
from accelerate.utils import gather_object
from trl.trainer.utils import nanstd

from ..rollouts.advantages import team_rewards
from ..rollouts.rollout import JointAction, Rollout
from ..tasks import local_rewards

# What `trainer.evaluate()` logs but describes training, not the evaluated team: the loss and PPO's clipping
# fractions (the policy is its own old policy here: always 0), the advantages (the learning signal of a step, not a
# score), the epoch, TRL's count of training tokens seen (`num_tokens`), and what only a training step logs
# (`grad_norm`, `learning_rate`). Kept: the team reward and its levels (`reward`, `rewards/*`, a task's own keys such
# as `coding/pass_at_1`), lengths (`completions/*`, `agents/*/completion_length`), turns, episodes, the policy's
# `entropy` (and `kl` to the base with `beta > 0`), and the evaluation's runtime.
TRAINING_METRICS = ("loss", "epoch", "num_tokens", "grad_norm", "learning_rate")
TRAINING_METRIC_PREFIXES = ("clip_ratio/",)
TRAINING_METRIC_SUFFIXES = ("/advantage_mean", "/advantage_std")


def is_training_metric(key: str) -> bool:
    """Whether an `evaluate()` metric (without its `eval_` prefix) describes training only (`TRAINING_METRICS`)."""
    return (
        key in TRAINING_METRICS or key.startswith(TRAINING_METRIC_PREFIXES) or key.endswith(TRAINING_METRIC_SUFFIXES)
    )


def log_rollout_metrics(
    metrics: dict,
    rollout: Rollout,
    *,
    agent_names: list[str],
    reward_func_names: list[str],
    reward_weights: torch.Tensor,
    eos_and_pad: list[list[int]],
    num_turns: int,
    state,
    mode: str,
    num_processes: int,
) -> None:
    """Team metrics over all joint actions of the batch, the same per turn (`turns/<t>/...`), per agent
    (`agents/<name>/...`) and TRL's completion-length metrics, all over every process, into `metrics` (TRL's
    `_metrics[mode]`); a training rollout's tokens count into `state.num_input_tokens_seen`. A completion's length is
    its model's tokens, as TRL counts them: tool results' tokens (`Sample.tool_mask` 0) are left out.
    `eos_and_pad[a]`: the tokens that end agent a's completions (its base's EOS and padding)."""
    rewards_per_func = rollout.batch_rewards_per_func
    rewards = team_rewards(rewards_per_func, reward_weights)
    for i, name in enumerate(reward_func_names):
        metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
        metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
    metrics["reward"].append(torch.nanmean(rewards).item())
    metrics["reward_std"].append(nanstd(rewards).item())
    # Joint actions that every function declined to score (None): their advantage is 0, they teach nothing.
    metrics["frac_unscored"].append(torch.isnan(rewards_per_func).all(dim=1).float().mean().item())
    metrics["frac_reward_zero_std"].append(rollout.turn_stats[0]["frac_reward_zero_std"])
    for name, value in rollout.metrics.items():
        metrics[name].append(value)

    local = [
        (
            s.turn,
            s.agent,
            len(s.prompt_ids),
            len(s.completion_ids) if s.tool_mask is None else sum(s.tool_mask),  # the model's tokens, as TRL
            s.completion_ids[-1] not in eos_and_pad[s.agent],
            s.advantage,
        )
        for s in rollout.samples
    ]
    rows = gather_object(local) if num_processes > 1 else local
    if not rows:  # a program rollout whose every episode failed: no completion to describe
        metrics["num_samples"].append(0.0)
        return
    turn, agent, prompt_length, length, truncated, advantage = torch.tensor(rows, dtype=torch.float64).T
    if mode == "train":
        state.num_input_tokens_seen += int(prompt_length.sum() + length.sum())
    metrics["num_tokens"] = [state.num_input_tokens_seen]
    metrics["num_samples"].append(float(len(length)))
    metrics["completions/mean_length"].append(length.mean().item())
    metrics["completions/min_length"].append(length.min().item())
    metrics["completions/max_length"].append(length.max().item())
    metrics["completions/clipped_ratio"].append(truncated.mean().item())
    terminated = length[truncated == 0]
    metrics["completions/mean_terminated_length"].append(terminated.mean().item() if len(terminated) else 0.0)
    for a, name in enumerate(agent_names):
        mine = agent == a
        metrics[f"agents/{name}/completion_length"].append(length[mine].mean().item())
        metrics[f"agents/{name}/clipped_ratio"].append(truncated[mine].mean().item())
        metrics[f"agents/{name}/advantage_mean"].append(advantage[mine].mean().item())
        metrics[f"agents/{name}/advantage_std"].append(advantage[mine].std().item() if mine.sum() > 1 else 0.0)
    if num_turns == 1:
        return
    for t, stats in enumerate(rollout.turn_stats):
        metrics[f"turns/{t}/reward"].append(stats["reward"])
        metrics[f"turns/{t}/return"].append(stats["return"])
        metrics[f"turns/{t}/num_nodes"].append(stats["num_nodes"])
        metrics[f"turns/{t}/frac_reward_zero_std"].append(stats["frac_reward_zero_std"])
        for a, name in enumerate(agent_names):
            mine = (agent == a) & (turn == t)
            metrics[f"turns/{t}/agents/{name}/completion_length"].append(length[mine].mean().item())


def log_local_rewards(metrics: dict, task, agent_names: list[str], samples: list, num_processes: int) -> None:
    """`agents/<name>/local_reward` into `metrics`: the mean of a task's local rewards of each agent's completions
    (logged, not trained on: MAGRPO optimises the team reward)."""
    if task is None or not task.local_reward_funcs:
        return
    for agent, name in enumerate(agent_names):
        mine = [s for s in samples if s.agent == agent]
        rows = [s.example for s in mine]
        columns = {key: [row[key] for row in rows] for key in (rows[0] if rows else {}) if key != "prompt"}
        values = local_rewards(
            task,
            name,
            [row["prompt"] for row in rows],
            [s.text for s in mine],
            turn=[s.turn for s in mine],
            **columns,
        )
        if values is not None:
            local = gather_object(values) if num_processes > 1 else values
            metrics[f"agents/{name}/local_reward"].append(sum(local) / max(1, len(local)))


def log_joint_actions(
    logs: dict,
    metrics: dict,
    pending_extra_logs: dict,
    pending_metrics: dict,
    joint_actions: list[JointAction],
    *,
    reward_func_names: list[str],
    num_turns: int,
    accelerator,
) -> None:
    """The completions table (TRL's `_logs`): one line per joint action (its turn, the agents' answers, rewards,
    advantage); then what reward functions logged through `log_extra` / `log_metric` (`pending_*`)."""
    logs["prompt"].extend(gather_object([ja.branch.example["prompt"] for ja in joint_actions]))
    logs["completion"].extend(
        gather_object(["\n\n".join(f"[{n}] {t}" for n, t in ja.completions.items()) for ja in joint_actions])
    )
    rewards_per_func = [ja.rewards_per_func for ja in joint_actions]
    for i, name in enumerate(reward_func_names):
        logs["rewards"][name].extend(gather_object([rewards[i] for rewards in rewards_per_func]))
    logs["advantages"].extend(gather_object([ja.advantage for ja in joint_actions]))
    if num_turns > 1:
        pending_extra_logs["turn"] = [ja.turn for ja in joint_actions]
        pending_extra_logs["return"] = [ja.value for ja in joint_actions]
    flush_reward_logs(logs, metrics, pending_extra_logs, pending_metrics, len(joint_actions), accelerator)


def flush_reward_logs(
    logs: dict, metrics: dict, pending_extra_logs: dict, pending_metrics: dict, num_local: int, accelerator
) -> None:
    """Gather what reward functions logged through `log_extra` / `log_metric`, as GRPOTrainer does."""
    for column in sorted(set(gather_object(list(pending_extra_logs)))):
        values = pending_extra_logs.get(column, [])  # a function may log at some turns only
        values = [*values, *[None] * (num_local - len(values))]
        logs["extra"][column].extend(gather_object(values))
    pending_extra_logs.clear()
    for name in sorted(set(gather_object(list(pending_metrics)))):
        values = pending_metrics.get(name, [])
        local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=accelerator.device)
        total, count = accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
        metrics[name].append(total / count)
    pending_metrics.clear()
