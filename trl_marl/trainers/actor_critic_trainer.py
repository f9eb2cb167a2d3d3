"""`IACTrainer` and `MAACTrainer`: a team's actors trained against critics that are LoRA adapters on the same base
(docs/critics.md). The team stack is [`TeamTrainer`]'s; this file adds the critics around it.

- Rollout: `TrajectoryRollout`, MAGRPO's episodes with one trajectory per prompt copy. After it, each critic values
  every joint action's history (no gradient), and `critic_advantages` turns the team rewards and values into each
  sample's advantage (GAE) and each critic's target (the λ-return).
- Rows: every trained agent's completion is a row, as in the other trainers, carrying its critic's input, the value
  the rollout computed and the target (`critic_ids`, `critic_mask`, `critic_index`, `old_values`, `value_targets`,
  `value_weights`); TRL shuffles and splits them with the rest.
- Loss: TRL's GRPO loss of the actors, unchanged; then, in the same `training_step`, the critics' forward (their rows
  routed to the critic adapters by a router of their own, the actors' routing idle) and a backward of the value loss
  scaled by `value_loss_coef`. Two backwards keep the critics' activations out of the actors' peak, and gradient
  checkpointing replays each forward under the routing it ran with.
- Parameters: the critic adapters and value heads (a `value_heads` submodule of the team's `PeftModel`, so that DDP
  and device moves carry them) train in their own optimizer parameter group (`critic_learning_rate`); the heads are
  saved as `value_heads.safetensors` beside the adapters, in checkpoints and by `save_model`, and reloaded on resume.
"""

import os
import textwrap

import torch
from safetensors.torch import load_file, save_file
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import disable_dropout_in_model, pad

from ..agents import cast_frozen_adapters_like_trained
from ..config import ActorCriticConfig, IACConfig, MAACConfig
from ..critics import attach_critics, critic_adapter_names
from ..generation.routing import AdapterRouter
from ..rollouts.rollout import Rollout
from ..rollouts.trajectory_rollout import TrajectoryRollout, critic_advantages, critic_inputs
from .team_trainer import TeamTrainer

VALUE_HEADS_FILE = "value_heads.safetensors"
# The MAGRPO authors' actor-critic paper (CoLLM-DC: a critic per agent, IAC here; CoLLM-CC: a centralised one, MAAC).
ACTOR_CRITIC_PAPER = {
    "title": "Learning Decentralized LLM Collaboration with Multi-Agent Actor Critic",
    "id": "2601.21972",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{liu2026actorcritic,
            title        = {{Learning Decentralized LLM Collaboration with Multi-Agent Actor Critic}},
            author       = {Shuo Liu and Tianle Chen and Ryan Amiri and Christopher Amato},
            year         = 2026,
            eprint       = {arXiv:2601.21972},
        }"""),
}
CRITIC_KEYS = ("critic_ids", "critic_mask", "critic_index", "old_values", "value_targets", "value_weights")


class ActorCriticTrainer(TeamTrainer):
    """What [`IACTrainer`] and [`MAACTrainer`] share: [`TeamTrainer`] with critics as LoRA adapters on the team's
    base. Takes [`TeamTrainer`]'s arguments, with an [`IACConfig`] or [`MAACConfig`] as `args`."""

    _config_class = ActorCriticConfig

    def __init__(self, model, reward_funcs=None, args=None, *more, **kwargs):
        self.critic_names: list[str] = []
        self._critic_batch = None  # the last rollout's critic inputs, values and targets, for its rows
        self._critic_micro_batch = None  # the critic rows of the micro-batch whose actors' loss was just taken
        super().__init__(model, reward_funcs, args, *more, **kwargs)
        distributed = self.accelerator.num_processes > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled
        if distributed:
            # The critics' backward follows the actors' in the same step: DDP would find the value heads outside the
            # forward's outputs, and DeepSpeed steps its optimizer at the actors' last backward.
            raise ValueError(
                f"{type(self).__name__} trains in one process for now, without DeepSpeed or FSDP: run it without "
                "`accelerate launch` across processes (one GPU or the CPU)."
            )
        if len(self.bases) > 1:
            raise ValueError(
                f"{type(self).__name__} puts its critics on the team's base: agents on other bases "
                f"({[name for name, base in zip(self.agent_names, self.agent_base) if base]}) are not supported yet."
            )
        peft_model = self.accelerator.unwrap_model(self.model)
        names = critic_adapter_names(self.agent_names, self.args._critic_kind)
        hidden_size = peft_model.get_base_model().config.get_text_config().hidden_size
        lora_config = peft_model.peft_config[self.adapter_names[0]]
        # A submodule of the PeftModel: in its parameters (the optimizer, DDP, gradient clipping) and moved with it.
        # Initialised on a fork of the random generators: the run samples what a MAGRPO run of the same seed samples.
        with torch.random.fork_rng():
            peft_model.value_heads = attach_critics(peft_model, names, lora_config, hidden_size)
        # On a 4-bit base TRL cast the agents' trainable adapters to bf16; the critics' are cast alike.
        cast_frozen_adapters_like_trained(peft_model, self.trained_adapters)
        if self.args.disable_dropout:  # as TRL's init did for the agents' adapters
            disable_dropout_in_model(peft_model)
        self.critic_names = names
        self.critic_router = AdapterRouter(peft_model, names)
        if self.optimizer is not None:  # given by the user, built before the critics existed
            held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            if not all(id(p) in held for p in self.critic_parameters()):
                raise ValueError(
                    f"The optimizer passed to {type(self).__name__} does not hold the critics' parameters, which the "
                    "trainer creates: leave `optimizers` out (the critics get a group at `critic_learning_rate`)."
                )

    @property
    def value_heads(self) -> torch.nn.ModuleDict:
        """The critics' value heads, by critic name."""
        return self.accelerator.unwrap_model(self.model).value_heads

    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """The critics' trainable parameters: their adapters' LoRA weights and their value heads."""
        peft_model = self.accelerator.unwrap_model(self.model)
        adapters = [
            parameter
            for path, parameter in peft_model.named_parameters()
            if any(f".{name}." in path for name in self.critic_names) and "lora_" in path
        ]
        return adapters + list(self.value_heads.parameters())

    def _set_adapter_trainability(self, models) -> None:
        super()._set_adapter_trainability(models)
        if self.critic_names:  # after a checkpoint reload too, which leaves only PEFT's active adapter trainable
            models[0].set_requires_grad(self.critic_names, requires_grad=True)

    def create_optimizer(self, model=None):
        """Trainer's optimizer over the actors' parameters, and the critics' in a group of their own at
        `critic_learning_rate` (the scheduler scales both)."""
        critic = self.critic_parameters()
        if self.optimizer is not None:  # given by the user, or built already
            return self.optimizer
        for parameter in critic:
            parameter.requires_grad_(False)
        try:
            super().create_optimizer(model)
        finally:
            for parameter in critic:
                parameter.requires_grad_(True)
        learning_rate = self.args.critic_learning_rate or self.args.learning_rate
        self.optimizer.add_param_group({"params": critic, "lr": learning_rate, "weight_decay": self.args.weight_decay})
        return self.optimizer

    # ------------------------------------------------------------------ rollout and values

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's trajectories, scored; in training, the critics' values of every joint action's history and
        the advantages and targets from them (`critic_advantages`)."""
        rollout = TrajectoryRollout(
            self.rollout_settings,
            num_generations,
            discount=self.args.discount,
            process_index=self.accelerator.process_index,
        ).run(inputs, **self._rollout_hooks(inputs, num_generations))
        if not self.model.training:  # evaluation scores the team; the advantages are not used
            return rollout
        ids = self._critic_input_ids(rollout)
        flat = [row for joint_action in ids for row in joint_action]
        critics = len(ids[0]) if ids else len(self.critic_names)
        names = [self.critic_names[c] for _ in ids for c in range(critics)]
        values = self.critic_values(flat, names).view(len(ids), critics)
        normalize = zscore if self.args.normalize_advantages else None
        targets = critic_advantages(rollout, values, self.args.discount, self.args.gae_lambda, normalize)
        self._critic_batch = (rollout, ids, values, targets)
        metrics = self._metrics["train"]
        if len(values):
            metrics["critic/value"].append(self.accelerator.gather(values.mean().reshape(1)).mean().item())
            scored = targets[~targets.isnan()]
            if len(scored):
                metrics["critic/target"].append(scored.mean().item())
        return rollout

    def _critic_input_ids(self, rollout: Rollout) -> list[list[list[int]]]:
        """The token ids each critic reads at each joint action, `[j][c]`: IAC, agent c's prompt ids as its completion
        was sampled from them; MAAC, the joint text of every agent's prompt (`critic_inputs`), tokenized."""
        if self.args._critic_kind == "iac":
            prompt_ids = {(s.node, s.position, s.agent): s.prompt_ids for s in rollout.samples}
            critic_inputs(rollout, "iac", self.agent_names)  # every agent acted at every joint action, or an error
            return [
                [prompt_ids[(ja.node, ja.index, agent)] for agent in range(len(self.agent_names))]
                for ja in rollout.joint_actions
            ]
        tokenizer = self._tokenizer
        return [
            [tokenizer(text, add_special_tokens=False)["input_ids"] for text in row]
            for row in critic_inputs(rollout, "maac", self.agent_names)
        ]

    @torch.no_grad()
    def critic_values(self, input_ids: list[list[int]], critics: list[str]) -> torch.Tensor:
        """Each text's value from its critic (`critics[i]` names row i's), without gradients, in chunks of
        `per_device_train_batch_size` rows: `(rows,)` float32 on the model's device."""
        device = self.accelerator.device
        values = []
        batch_size = self.args.per_device_train_batch_size
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for start in range(0, len(input_ids), batch_size):
                ids, mask = left_padded(input_ids[start : start + batch_size], self._tokenizer.pad_token_id, device)
                with self.compute_loss_context_manager():
                    values.append(self._critic_forward(self.model, ids, mask, critics[start : start + batch_size]))
                self.critic_router.route(None)
        return torch.cat(values) if values else torch.zeros(0, device=device)

    def _critic_forward(self, model, input_ids, attention_mask, critics: list[str]) -> torch.Tensor:
        """Values `(rows,)` of left-padded rows, row i through critic `critics[i]`'s adapter and value head. The
        routing stays set (gradient checkpointing replays the forward in the backward); the caller clears it."""
        self._clear_routing()  # the actors' routing idle: a layer adds the critics' deltas alone
        self.critic_router.route(critics)
        peft_model = self.accelerator.unwrap_model(self.model)
        captured = []
        # The final hidden state of each row's last token is the output layer's input under `logits_to_keep=1`: the
        # 49k-vocabulary logits are computed for one position only.
        handle = peft_model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: captured.append(args[0])
        )
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False)
        finally:
            handle.remove()
        hidden = captured[-1][:, -1:]
        last = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        values = torch.zeros(len(critics), dtype=torch.float32, device=hidden.device)
        for name in dict.fromkeys(critics):
            rows = torch.tensor([i for i, critic in enumerate(critics) if critic == name], device=hidden.device)
            values[rows] = self.value_heads[name](hidden[rows], last[rows]).to(hidden.device)
        return values

    # ------------------------------------------------------------------ rows and losses

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        output = super()._generate_and_score_completions(inputs)
        batch, self._critic_batch = self._critic_batch, None
        if batch is not None:
            output.update(self._critic_rows(*batch, num_rows=len(output["advantages"])))
        return output

    def _critic_rows(self, rollout, ids, values, targets, num_rows: int) -> dict:
        """Each trained row's critic input, old value, target and weight, padded to `num_rows` with weight 0. A
        MAAC joint action's one target weighs once, on its first trained agent's row; an unscored one (target NaN)
        not at all."""
        iac = self.args._critic_kind == "iac"
        at = {(ja.node, ja.index): j for j, ja in enumerate(rollout.joint_actions)}
        samples = [s for s in rollout.samples if s.agent in self.trained_agents]
        rows, index, old, target, weight, seen = [], [], [], [], [], set()
        for sample in samples:
            j = at[(sample.node, sample.position)]
            critic = sample.agent if iac else 0
            rows.append(ids[j][critic])
            index.append(critic)
            old.append(values[j, critic])
            target.append(targets[j, critic].nan_to_num(0.0))
            weight.append(float(not targets[j, critic].isnan() and (iac or j not in seen)))
            seen.add(j)
        filler = num_rows - len(rows)
        rows += [rows[0] if rows else [self._tokenizer.pad_token_id]] * filler
        device = self.accelerator.device
        old, target = [v.to(device) for v in old], [t.to(device) for t in target]  # the advantages' device may differ
        critic_ids, critic_mask = left_padded(rows, self._tokenizer.pad_token_id, device)
        zeros = [torch.zeros((), device=device)] * filler
        return {
            "critic_ids": critic_ids,
            "critic_mask": critic_mask,
            "critic_index": torch.tensor(index + [0] * filler, dtype=torch.long, device=device),
            "old_values": torch.stack([*old, *zeros]).float(),
            "value_targets": torch.stack([*target, *zeros]).float(),
            "value_weights": torch.tensor(weight + [0.0] * filler, device=device),
        }

    def _compute_loss(self, model, inputs):
        if model.training and "value_weights" in inputs:  # the critics' loss follows in `training_step`
            self._critic_micro_batch = {key: inputs[key] for key in CRITIC_KEYS}
        return super()._compute_loss(model, inputs)

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)  # the actors' loss, backward, routing cleared
        batch, self._critic_micro_batch = self._critic_micro_batch, None
        if batch is not None and self.args.value_loss_coef > 0:
            self._value_step(model, batch)
        return loss

    def _value_step(self, model, batch: dict) -> None:
        """The critics' forward on the micro-batch's weighted rows and the backward of their value loss."""
        rows = batch["value_weights"] > 0
        if not rows.any():
            return
        input_ids, attention_mask = batch["critic_ids"][rows], batch["critic_mask"][rows]
        keep = attention_mask.any(dim=0)  # columns that are padding in every kept row
        input_ids, attention_mask = input_ids[:, keep], attention_mask[:, keep]
        critics = [self.critic_names[c] for c in batch["critic_index"][rows].tolist()]
        try:
            with self.compute_loss_context_manager():
                values = self._critic_forward(model, input_ids, attention_mask, critics)
            loss = value_loss(
                values, batch["old_values"][rows], batch["value_targets"][rows], self.args.value_clip_range
            )
            self.accelerator.backward(self.args.value_loss_coef * loss / self.current_gradient_accumulation_steps)
        finally:
            self.critic_router.route(None)
        self._metrics["train"]["critic/value_loss"].append(
            self.accelerator.gather(loss.detach().reshape(1)).mean().item()
        )

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The team (`TeamTrainer.save_model`; the critic adapters are saved with it, in `<critic>/` folders beside
        the agents') and the critics' value heads in `value_heads.safetensors`."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            folder = output_dir or self.args.output_dir
            heads = {name: tensor.detach().cpu() for name, tensor in self.value_heads.state_dict().items()}
            save_file(heads, os.path.join(folder, VALUE_HEADS_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        path = os.path.join(resume_from_checkpoint, VALUE_HEADS_FILE)
        if not os.path.exists(path):  # checked before anything loads: the team in memory stays as it was
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {VALUE_HEADS_FILE}: it is not a checkpoint of {type(self).__name__} "
                "(its critics' value heads are missing). Resume from one of this trainer's checkpoints."
            )
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        self.value_heads.load_state_dict(load_file(path))  # in place: the optimizer keeps the same parameters


class IACTrainer(ActorCriticTrainer):
    """Independent actor-critic: one critic per agent, each a LoRA adapter (`critic_<agent>`) on the team's base and a
    value head, reading its agent's own prompt of the turn (docs/critics.md). Takes [`TeamTrainer`]'s arguments with
    an [`IACConfig`] as `args`."""

    _tag_names = ["trl", "trl-marl", "iac"]
    _name = "IAC"
    _config_class = IACConfig
    _paper = ACTOR_CRITIC_PAPER


class MAACTrainer(ActorCriticTrainer):
    """Multi-agent actor-critic: one centralised critic for the team, a LoRA adapter (`critic`) on the team's base and
    a value head, reading every agent's prompt of the turn (docs/critics.md). Takes [`TeamTrainer`]'s arguments with a
    [`MAACConfig`] as `args`."""

    _tag_names = ["trl", "trl-marl", "maac"]
    _name = "MAAC"
    _config_class = MAACConfig
    _paper = ACTOR_CRITIC_PAPER


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` padded on the left to one length with TRL's `pad`: `(input_ids, attention_mask)`, so that each row's
    last token is in the last column."""
    ids = [torch.tensor(row, dtype=torch.long) for row in rows]
    input_ids = pad(ids, padding_value=pad_id, padding_side="left")
    attention_mask = pad([torch.ones_like(row) for row in ids], padding_value=0, padding_side="left")
    return input_ids.to(device), attention_mask.to(device)


def zscore(advantages: torch.Tensor) -> torch.Tensor:
    """Each column's advantages less their mean, over their standard deviation (0 for a single row)."""
    centred = advantages - advantages.mean(dim=0, keepdim=True)
    if len(advantages) < 2:
        return centred
    return centred / (advantages.std(dim=0, keepdim=True) + 1e-4)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor, clip: float | None):
    """½ mean (V − R)², or with `clip`, ½ mean max((V − R)², (V_clipped − R)²), V_clipped = V_old + clamp(V − V_old,
    ±clip), as TRL's PPO."""
    loss = (values - targets) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - targets) ** 2)
    return 0.5 * loss.mean()
