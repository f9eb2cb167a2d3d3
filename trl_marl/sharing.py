"""Saving and sharing the whole team from a trainer (a mixin of `TeamTrainer`).

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

from .hub import CARD_FILE, copy_team_files, hub_base_model, hub_snapshot_id, make_adapter_configs_portable
from .metrics import is_training_metric
from .team import base_model_name, team_spec, write_team_file
from .team_card import CardContents, team_model_card


class TeamSharingMixin:
    """`save_model`'s team files, the team's model card and the team's pushes for a `TeamTrainer`."""

    def _save_team(self, folder: str | os.PathLike) -> None:
        """Write `team.json`, make the adapter configs portable and write the team's card, in `folder`, where
        `save_model` has just saved the adapters and the tokenizer."""
        spec = self._team_spec()
        write_team_file(folder, spec)
        make_adapter_configs_portable(folder, self.adapter_names, spec["base_model"])
        self._team_card(spec, folder).save(Path(folder) / CARD_FILE)

    def _team_spec(self) -> dict:
        base = self.accelerator.unwrap_model(self.model).get_base_model()
        used = self.rollout_settings  # the transition and scheduler the rollouts used (fixed at __init__)
        name = base_model_name(base)
        name = hub_snapshot_id(name) or name  # a model loaded from its Hub cache snapshot: its repo id, as by id
        return team_spec(self.args, self.agent_adapters, name, used.transition, used.scheduler, self.task)

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """The team's model card in `output_dir/README.md` (TRL's hook, with TRL's arguments)."""
        if not self.is_world_process_zero():
            return
        card = self._team_card(self._team_spec(), self.args.output_dir, model_name, dataset_name, tags)
        card.save(Path(self.args.output_dir) / CARD_FILE)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        pushes = self.is_world_process_zero() and self.args.hub_strategy != HubStrategy.END
        in_progress = getattr(self, "push_in_progress", None)
        busy = in_progress is not None and not in_progress.is_done()
        if pushes and (self.args.hub_always_push or not busy):  # as Trainer decides whether this push happens
            copy_team_files(checkpoint_folder, self.args.output_dir, self.adapter_names)
        super()._push_from_checkpoint(checkpoint_folder)

    def _team_card(
        self,
        spec: dict,
        folder: str | os.PathLike,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ):
        hub_model_id = getattr(self, "hub_model_id", None)
        if model_name is None:
            model_name = hub_model_id.split("/")[-1] if hub_model_id else Path(self.args.output_dir).name
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        contents = CardContents(
            model_name=model_name,
            load_from=hub_model_id or folder_name(folder, self.args.output_dir),
            from_hub=hub_model_id is not None,
            trainer_name=type(self).__name__,
            paper=self._paper,
            base_model_id=hub_base_model(spec["base_model"]),
            settings=self._card_settings(spec),
            tags=list(dict.fromkeys([*self._tag_names, *extra_tags])),
            dataset_name=dataset_name,
            example=self._card_example(),
            tracking=_tracking_links(),
        )
        contents.metrics_step, contents.metrics = _last_logged(self.state.log_history, eval_=False)
        _, contents.eval_metrics = _last_logged(self.state.log_history, eval_=True)
        return team_model_card(spec, contents)

    def _card_settings(self, spec: dict) -> dict:
        """The training settings the card lists (config field names; None values are left out)."""
        args = self.args
        lora = self.accelerator.unwrap_model(self.model).peft_config[self.adapter_names[0]]
        targets = lora.target_modules
        return {
            "algorithm": spec["algorithm"],
            "task": spec.get("task"),
            "reward_funcs": self.reward_func_names,
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
            "global_step": self.state.global_step,
            "max_steps": args.max_steps if args.max_steps > 0 else None,
            "num_train_epochs": args.num_train_epochs if args.max_steps <= 0 else None,
            "max_completion_length": args.max_completion_length,
            "loss_type": self.loss_type,
            "beta": self.beta,
            "lora_r": lora.r,
            "lora_alpha": lora.lora_alpha,
            "lora_dropout": lora.lora_dropout,
            "lora_target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
            "seed": args.seed,
        }

    def _card_example(self) -> dict | None:
        """The first training row (its prompt and columns), for the card's `Team.run` example."""
        dataset = self.train_dataset
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
