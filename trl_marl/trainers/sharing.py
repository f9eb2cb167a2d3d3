"""Saving and sharing the whole team from a trainer: what `TeamTrainer.save_model`, `create_model_card` and
`_push_from_checkpoint` write.

Every save (`save_model`, each checkpoint, `push_to_hub`) leaves a team that loads on another machine:

- `team.json`, which `trl_marl.load_team` reads;
- each adapter's `adapter_config.json` naming the base model as `team.json` does (the default model's Hub id, not its
  local conversion; a Hub cache snapshot's repo id, not its folder; `hub.make_adapter_configs_portable`);
- `README.md`, the team's model card (`team_card.py`), written after PEFT's own card so that it is the one kept.
  `create_model_card`, TRL's hook (each checkpoint, `push_to_hub`), writes the same card into `output_dir`.

`Trainer.push_to_hub` uploads `output_dir` whole (adapter folders included). `_push_from_checkpoint` (`hub_strategy`
other than "end") copies only top-level model files from the checkpoint into `output_dir` before uploading it, so the
team's folders, `team.json` and the card are copied too.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import is_wandb_available
from transformers.trainer_utils import HubStrategy
from trl.trainer.utils import get_comet_experiment_url, get_trackio_space_url

from ..agents import BASE_KEYS
from ..rollouts.rollout import RolloutSettings
from ..team.hub import CARD_FILE, copy_team_files, hub_base_model, hub_snapshot_id, make_adapter_configs_portable
from ..team.saved import base_model_name, team_spec, write_team_file
from ..team.team_card import CardContents, team_model_card
from .metrics import is_training_metric


def save_team(folder: str | os.PathLike, spec: dict, adapter_names: list[str], card) -> None:
    """Write `team.json`, make the adapter configs portable and write the team's card, in `folder`, where
    `save_model` has just saved the adapters and the tokenizer."""
    write_team_file(folder, spec)
    base_of = {agent["adapter"]: agent.get("model", spec["base_model"]) for agent in spec["agents"]}
    for base in dict.fromkeys(base_of.values()):
        adapters = [name for name in adapter_names if base_of.get(name, spec["base_model"]) == base]
        make_adapter_configs_portable(folder, adapters, base)
    card.save(Path(folder) / CARD_FILE)


def trained_team_spec(
    base_model,
    args,
    agent_adapters: list[str],
    rollout_settings: RolloutSettings,
    task,
    other_bases: list | None = None,
    agent_base: list[int] | None = None,
    base_loadings: list[dict] | None = None,
    team_tools: tuple | None = None,
) -> dict:
    """`team.json`'s content for a trainer's team: its config, adapters, base model (a Hub cache snapshot by its repo
    id), the transition and scheduler its rollouts used, and its `team_tools` (the trainer's `tools=` and the
    environment factory its episodes used; None: neither). With agents on several bases (`other_bases`, the loaded
    models after the first; `agent_base`, each agent's base index; `base_loadings`, how each of them loaded:
    `bases.loading_of`, kept in `BasePlan.loading` when it loads) each agent on another base records its `model`
    by the same rule and its base's `load_in_4bit` and `dtype`, set by the agent or followed from the trainer's; the
    agents on the first base record none."""
    used = rollout_settings
    tools, environment_factory = team_tools or (None, None)
    spec = team_spec(
        args, agent_adapters, recorded_name(base_model), used.transition, used.scheduler, task, tools,
        environment_factory,
    )  # fmt: skip
    for agent, base in zip(spec["agents"], agent_base or [0] * len(spec["agents"])):
        if base == 0:
            for key in BASE_KEYS:
                agent.pop(key, None)
        else:
            agent["model"] = recorded_name(other_bases[base - 1])
            if base_loadings:
                agent.update(base_loadings[base - 1])
    return spec


def recorded_name(model) -> str:
    """A loaded base model's name in `team.json`: its Hub id (the default model's, or a Hub cache snapshot's repo
    id), else its path."""
    name = base_model_name(model)
    return hub_snapshot_id(name) or name


def push_team_files(checkpoint_folder: str, output_dir: str, adapter_names: list[str], args, push_in_progress) -> None:
    """Before `Trainer._push_from_checkpoint` uploads `output_dir`: copy the checkpoint's adapter folders, `team.json`
    and card there when Trainer is about to push (it copies only top-level model files itself)."""
    busy = push_in_progress is not None and not push_in_progress.is_done()
    if args.hub_strategy != HubStrategy.END and (args.hub_always_push or not busy):
        copy_team_files(checkpoint_folder, output_dir, adapter_names)


def team_card(
    spec: dict,
    folder: str | os.PathLike,
    *,
    args,
    state,
    hub_model_id: str | None,
    trainer_name: str,
    paper: dict | None,
    tag_names: list[str],
    settings: dict,
    example: dict | None,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | list[str] | None = None,
):
    """The team's model card for the team saved in `folder` (`team_card.team_model_card`): how to load it (by Hub id
    once pushed, else the output folder's name), its base, training settings and last logged metrics."""
    if model_name is None:
        model_name = hub_model_id.split("/")[-1] if hub_model_id else Path(args.output_dir).name
    extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
    contents = CardContents(
        model_name=model_name,
        load_from=hub_model_id or folder_name(folder, args.output_dir),
        from_hub=hub_model_id is not None,
        trainer_name=trainer_name,
        paper=paper,
        base_model_id=hub_base_model(spec["base_model"]),
        settings=settings,
        tags=list(dict.fromkeys([*tag_names, *extra_tags])),
        dataset_name=dataset_name,
        example=example,
        tracking=_tracking_links(),
    )
    contents.metrics_step, contents.metrics = _last_logged(state.log_history, eval_=False)
    _, contents.eval_metrics = _last_logged(state.log_history, eval_=True)
    return team_model_card(spec, contents)


def card_settings(spec: dict, args, lora, *, reward_func_names, loss_type: str, beta: float, global_step: int) -> dict:
    """The training settings the card lists (config field names; None values are left out)."""
    targets = lora.target_modules
    return {
        "algorithm": spec["algorithm"],
        "task": spec.get("task"),
        "reward_funcs": reward_func_names,
        "agents": [agent["name"] for agent in spec["agents"]],
        "frozen_agents": list(args.frozen_agents),
        "adapter_mode": args.adapter_mode,
        "num_turns": args.num_turns,
        "scheduler": spec["scheduler"],
        "joint_mode": getattr(args, "joint_mode", None),
        "discount": getattr(args, "discount", None),
        "team_reward_weight": getattr(args, "team_reward_weight", None),
        "continuation": getattr(args, "continuation", None),
        "baseline": args.baseline,
        "num_generations": args.num_generations,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "learning_rate": args.learning_rate,
        "global_step": global_step,
        "max_steps": args.max_steps if args.max_steps > 0 else None,
        "num_train_epochs": args.num_train_epochs if args.max_steps <= 0 else None,
        "max_completion_length": args.max_completion_length,
        "loss_type": loss_type,
        "beta": beta,
        "lora_r": lora.r,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.lora_dropout,
        "lora_target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
        "seed": args.seed,
    }


def card_example(dataset) -> dict | None:
    """The first training row (its prompt and columns), for the card's `Team.run` example."""
    try:
        return dict(dataset[0]) if dataset is not None and len(dataset) > 0 else None
    except (TypeError, KeyError, IndexError, NotImplementedError):  # an IterableDataset, or rows without keys
        return None


def folder_name(folder: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    """How a card names the saved `folder` it is in: by the output folder's name, as TRL's cards and `push_to_hub`
    name the model (a checkpoint as `<output folder's name>/checkpoint-N`; a folder outside `output_dir` by its own
    name), never by the machine's absolute path."""
    folder, output_dir = Path(folder).resolve(), Path(output_dir).resolve()
    if folder.is_relative_to(output_dir):
        return (Path(output_dir.name) / folder.relative_to(output_dir)).as_posix()
    return folder.name


def _last_logged(log_history: list[dict], eval_: bool) -> tuple[int | None, dict[str, float]]:
    """The step and the numeric metrics of the last log entry holding the team reward (`reward`, or `eval_reward`);
    an evaluation's without the keys that describe training only (`metrics.is_training_metric`: the loss, clipping,
    advantages, token count)."""
    key = "eval_reward" if eval_ else "reward"
    for entry in reversed(log_history):
        if key in entry:
            numeric = {name: value for name, value in entry.items() if isinstance(value, (int, float))}
            metrics = {
                name: float(value)
                for name, value in numeric.items()
                if not isinstance(value, bool) and name not in ("step", "epoch")
                if not (eval_ and is_training_metric(name.removeprefix("eval_")))
            }
            reward = metrics.pop(key)
            return entry.get("step"), {key: reward, **metrics}
    return None, {}


def _tracking_links() -> dict[str, str]:
    """The experiment trackers' pages of this run, as TRL's card links them."""
    links = {}
    if is_wandb_available():
        import wandb

        if wandb.run is not None:
            links["Visualize in Weights & Biases"] = wandb.run.url
    if (trackio_url := get_trackio_space_url()) is not None:
        links["Visualize in Trackio"] = trackio_url
    if (comet_url := get_comet_experiment_url()) is not None:
        links["Visualize in Comet"] = comet_url
    return links
