"""`MAGRPOTrainer`: TRL's `GRPOTrainer` where each prompt is answered by a team of LoRA agents on one base model.

What is multi-agent, and therefore overridden:
- `_generate_and_score_completions`: the MAGRPO tree of each prompt (`rollout.TreeRollout`; one turn unless
  `num_turns > 1`): every agent answers at every node (one `generate` call per turn for the whole team, rows routed
  to their agent's adapter); joint actions get one team reward; returns and advantages follow MAGRPO (§3 of
  DESIGN.md); the result holds one row per agent completion with `agent_index`, `turn_index`, `group_index`, padded
  with loss-free rows to what TRL's split needs.
- `_get_per_token_logps_and_entropies` / `_compute_loss`: each row's log-probs come from its agent's adapter.
- `save_model`: also writes `team.json`, which `trl_marl.load_team` reads.
- checkpoints (`checkpoints.CheckpointMixin`): complete or ignored, never half-written; resume is exact.
Everything else (loss types, clipping, KL to the base, gradient accumulation, logging, checkpoints) is TRL's.
"""

import asyncio
import functools
import math
from collections.abc import Callable

import torch
from accelerate.utils import gather_object, set_seed
from datasets import Dataset, IterableDataset
from transformers import PreTrainedTokenizerBase, TrainerCallback
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import (
    create_model_from_path,
    is_async_callable,
    pad,
)

from .agents import (
    agent_adapter_names,
    agent_prompt,
    attach_agent_adapters,
    keep_4bit_weights_trainable,
    lora_config_from_args,
)
from .atgrpo import ATGRPORollout
from .checkpoints import CheckpointMixin
from .config import ATGRPOConfig, MAGRPOConfig
from .metrics import TeamMetricsMixin
from .registry import load_plugin
from .rewards import (
    LOCAL_REWARD_ARGUMENTS,
    TEAM_REWARD_ARGUMENTS,
    TRANSITION_ARGUMENTS,
    TeamRewardFunc,
    check_dataset_columns,
    checked_team_reward,
)
from .rollout import (
    PER_ROW_LOSS_TYPES,
    JointAction,
    Rollout,
    TreeRollout,
    default_transition,
    pad_rows,
    padding_loss_scale,
)
from .routing import BASE, AdapterRouter
from .scheduling import resolve_scheduler
from .tasks import local_rewards, resolve_task
from .team import base_model_name, team_spec, write_team_file

BASE_ROW = -1  # the agent index of a row routed to the base model alone (the KL reference)


def model_init_kwargs_for(args: MAGRPOConfig, quantization_config=None) -> dict:
    """`from_pretrained` keywords for a model given by id or path: `args.model_init_kwargs`, the quantization config,
    and the device map.

    Under DDP or DeepSpeed every process holds the whole model on its own device, so `device_map="auto"` (which would
    spread it over every visible GPU) is off. A quantized model must still be placed while it loads (bitsandbytes
    quantizes on the device): it goes to this process's device, `{"": <device>}`, never to `None` (the CPU).
    """
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    state = args.distributed_state
    if state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        kwargs["device_map"] = {"": state.device} if kwargs.get("quantization_config") is not None else None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def adapter_parameters(model: torch.nn.Module, adapter_names: list[str]) -> dict[str, list[torch.nn.Parameter]]:
    """Each adapter's parameters, found by PEFT's naming: `...<container>.<adapter>.<weight>` where the container is
    a `lora_*` module dict (`lora_A`, `lora_B`, `lora_magnitude_vector`, ...) or `modules_to_save`."""
    found = {name: [] for name in adapter_names}
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        for container, adapter in zip(parts, parts[1:]):
            if adapter in found and (container.startswith("lora_") or container == "modules_to_save"):
                found[adapter].append(parameter)
                break
    return found


def cast_frozen_adapters_like_trained(model: torch.nn.Module, trained_adapters: list[str]) -> None:
    """Give the LoRA matrices of frozen adapters the dtype of the trained ones.

    On a quantized base TRL casts the adapter weights that require grad to bf16 (QLoRA's recommendation); frozen
    adapters require none, stay float32, and would turn every routed matmul of a mixed batch (the agents' matrices
    are concatenated) into a float32 one.
    """
    parameters = adapter_parameters(model, list(model.peft_config))
    trained = [p for name in trained_adapters for p in parameters.get(name, []) if p.ndim == 2]
    if not trained:
        return
    dtype = trained[0].dtype
    for name, params in parameters.items():
        if name not in trained_adapters:
            for param in params:
                if param.ndim == 2 and param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)


class MAGRPOTrainer(CheckpointMixin, TeamMetricsMixin, GRPOTrainer):
    """Multi-agent GRPO (MAGRPO, arXiv 2508.04652) as a thin [`~trl.GRPOTrainer`] subclass.

    Args:
        model: a model id or local path, a loaded `PreTrainedModel` (adapters are added, one per agent), or a
            `PeftModel` that already carries one adapter per agent (named after the agents).
        reward_funcs: team reward function(s) or reward plugin names; a function is
            `f(prompts, completions, **kwargs) -> list[float | None]`, where each
            completion is a mapping agent name -> text and kwargs carry the dataset columns, `completion_ids` (a
            mapping agent name -> token ids), `turn`, `history` (the branch's earlier joint actions) and TRL's
            `trainer_state`, `log_extra`, `log_metric`.
        args: a [`MAGRPOConfig`] (it names the agents).
        quantization_config: e.g. a 4-bit `BitsAndBytesConfig`, used when `model` is an id or path.
        peft_config: a `LoraConfig` for every agent's adapter; defaults to one built from the `lora_*` fields.
        transition: with `num_turns > 1`, what each agent sees at the next turn of one branch:
            `f(prompt, joint_action, history, turn, observations, reward, **columns)` returns one prompt per agent (a
            list, or a dict agent name -> prompt) or `NextTurn(prompts, done)`; see [`~trl_marl.rollout`]. Defaults to
            [`~trl_marl.rollout.default_transition`]: the task prompt again (the scheduler adds what was said).
        scheduler: a scheduler object or plugin name overriding `args.scheduler` (see `trl_marl.scheduling`).
        task: a [`~trl_marl.Task`] or task plugin name; it supplies the reward functions, training data and transition
            when those are not given (build `args` with `MAGRPOConfig.for_task` to take its agents and turns too).
        The other arguments are TRL's.
    """

    _tag_names = ["trl", "trl-marl", "magrpo"]
    _name = "MAGRPO"
    _config_class = MAGRPOConfig

    def __init__(
        self,
        model,
        reward_funcs: TeamRewardFunc | str | list[TeamRewardFunc | str] | None = None,
        args: MAGRPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        quantization_config=None,
        peft_config=None,
        transition: Callable | None = None,
        scheduler=None,
        task=None,
    ):
        config_class = self._config_class
        if not isinstance(args, config_class) or type(self) is MAGRPOTrainer and isinstance(args, ATGRPOConfig):
            other = "; an ATGRPOConfig goes to ATGRPOTrainer" if isinstance(args, ATGRPOConfig) else ""
            raise TypeError(
                f"`args` must be a {config_class.__name__} naming the agents, got {type(args).__name__}{other}, e.g. "
                f"{config_class.__name__}(output_dir='out', agents=['concise', 'detailed'])."
            )
        # A task supplies what was not given: team rewards, training data, transition.
        task = resolve_task(task) if task is not None else None
        if task is not None:
            reward_funcs = reward_funcs if reward_funcs is not None else list(task.reward_funcs)
            train_dataset = train_dataset if train_dataset is not None else task.dataset("train")
            transition = transition or task.transition
        reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not reward_funcs or reward_funcs == [None]:
            raise ValueError("`reward_funcs` is empty: give at least one team reward function (or a task).")
        # A name is a reward plugin (`trl-marl list rewards`).
        reward_funcs = [load_plugin("rewards", f) if isinstance(f, str) else f for f in reward_funcs]
        reward_funcs = [checked_team_reward(func, args.reward_timeout) for func in reward_funcs]
        if transition is not None and not callable(transition):
            raise TypeError(f"`transition` must be callable, got {transition!r}.")
        # A column that a reward, local reward or transition reads and the data lacks fails here, not mid-training.
        consumers = [("Team reward", func, TEAM_REWARD_ARGUMENTS) for func in reward_funcs]
        for agent, funcs in (task.local_reward_funcs if task is not None else {}).items():
            consumers += [(f"Local reward of agent '{agent}'", func, LOCAL_REWARD_ARGUMENTS) for func in funcs]
        if transition is not None and args.num_turns > 1:
            consumers.append(("Transition", transition, TRANSITION_ARGUMENTS))
        check_dataset_columns(train_dataset, consumers, "train dataset")
        eval_datasets = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
        for name, dataset in eval_datasets.items():
            check_dataset_columns(dataset, consumers, f"eval dataset {name}".strip())
        self.task = task
        self.transition = transition or default_transition
        # Resolved before any model loads: an unknown or broken scheduler plugin fails here.
        self.scheduler = resolve_scheduler(scheduler if scheduler is not None else args.scheduler)

        if isinstance(model, str):
            model = create_model_from_path(model, **model_init_kwargs_for(args, quantization_config))

        self.agent_names = args.agent_names
        self.agent_adapters = agent_adapter_names(args)
        self.adapter_names = list(dict.fromkeys(self.agent_adapters))  # each adapter once
        # As TRL: seed before creating adapters, so their initialisation is reproducible (and equal to TRL's).
        set_seed(args.seed)
        model = attach_agent_adapters(model, self.agent_adapters, peft_config or lora_config_from_args(args))
        # Frozen agents act but do not train: their adapters (unless shared with a trained agent) get no gradient,
        # so the optimizer, built from what requires grad, never holds them.
        self.trained_agents = [i for i, name in enumerate(self.agent_names) if name not in args.frozen_agents]
        self.trained_adapters = list(dict.fromkeys(self.agent_adapters[i] for i in self.trained_agents))
        self._set_adapter_trainability(model)

        if args.ddp_find_unused_parameters is None and len(self.adapter_names) > 1:
            # A micro-batch may hold rows of only some agents; the other adapters then get no gradient under DDP.
            args.ddp_find_unused_parameters = True

        # TRL would clone an adapter named "default" as the KL reference when given a PeftModel with beta != 0; with
        # fresh adapters the base model (adapters disabled) is every agent's reference, which TRL uses when no "ref"
        # adapter exists. model_init_kwargs were used above; TRL would warn that they are ignored.
        beta, model_init_kwargs = args.beta, args.model_init_kwargs
        args.beta, args.model_init_kwargs = 0.0, None
        try:
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
            )
        finally:
            args.beta, args.model_init_kwargs = beta, model_init_kwargs
        self.beta = beta

        deepspeed_plugin = self.accelerator.state.deepspeed_plugin
        if args.num_turns > 1 and (self.is_fsdp_enabled or deepspeed_plugin and deepspeed_plugin.zero_stage == 3):
            raise ValueError(
                f"`num_turns={args.num_turns}` is not supported with FSDP or DeepSpeed ZeRO-3: trees differ between "
                "processes, so they run different numbers of `generate` calls, which sharded parameters cannot serve. "
                "Use DDP or ZeRO-1/2, or `num_turns=1`."
            )
        if (
            args.num_turns > 1
            and self.loss_type in PER_ROW_LOSS_TYPES
            and (self._entropy_bonus_enabled or self.aux_loss_enabled)
        ):
            raise ValueError(
                f"`loss_type={self.loss_type!r}` with `num_turns={args.num_turns}` and an entropy bonus "
                "(`entropy_coef` / `use_adaptive_entropy`) or a router aux loss is not supported: trees pad their "
                "rows, and the padding correction of this per-row loss would scale those terms too. Use "
                "`loss_type='dapo'` (or 'bnpo'), which count real tokens only, or turn the extra term off."
            )
        self.num_agents = args.num_agents
        self.joint_mode = args.joint_mode
        self.baseline = args.baseline
        self._use_chat_template = getattr(self.processing_class, "chat_template", None) is not None
        unwrapped = self.accelerator.unwrap_model(self.model)
        # Every forward is routed, a one-adapter team's too: the KL reference goes to the base model through the router
        # (PEFT's `disable_adapter` would change which adapters require grad). One adapter's rows are computed as PEFT
        # computes them, so a one-agent team stays numerically identical to GRPOTrainer.
        self.router = AdapterRouter(unwrapped, self.adapter_names)
        keep_4bit_weights_trainable(unwrapped)
        cast_frozen_adapters_like_trained(unwrapped, self.trained_adapters)
        self._adapter_parameters = adapter_parameters(unwrapped, self.adapter_names)
        self._rows_agent_index: torch.Tensor | None = None

    def _set_adapter_trainability(self, model) -> None:
        """Trained adapters require grad, frozen ones do not. Set at creation and after a checkpoint reload (which
        leaves only PEFT's active adapter trainable); the optimizer is built from what requires grad."""
        model.set_requires_grad(self.trained_adapters, requires_grad=True)
        frozen_adapters = [name for name in self.adapter_names if name not in self.trained_adapters]
        if frozen_adapters:
            model.set_requires_grad(frozen_adapters, requires_grad=False)

    def _check_adapters_train(self) -> None:
        """Every trained agent's adapter requires grad and is in the optimizer; a frozen one requires no grad.

        A PEFT call that ends in `set_adapter` (`disable_adapter()`, `use_adapter(model, None)`) turns gradients off on
        every adapter but the active one, and the agents concerned would silently stop learning. Checked before every
        loss (a few hundred flag reads); the optimizer's membership is not checked where DeepSpeed or FSDP flatten the
        parameters into their own buffers.
        """
        optimizer = getattr(self, "optimizer", None)
        flattened = self.is_deepspeed_enabled or self.is_fsdp_enabled
        in_optimizer = None
        if optimizer is not None and not flattened:
            in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        problems = []
        for adapter, parameters in self._adapter_parameters.items():
            agents = [name for name, used in zip(self.agent_names, self.agent_adapters) if used == adapter]
            trained = adapter in self.trained_adapters
            if trained and not all(p.requires_grad for p in parameters):
                problems.append(f"adapter '{adapter}' of agents {agents} no longer requires grad")
            elif trained and in_optimizer is not None and not all(id(p) in in_optimizer for p in parameters):
                problems.append(f"adapter '{adapter}' of agents {agents} is not in the optimizer")
            elif not trained and any(p.requires_grad for p in parameters):
                problems.append(f"adapter '{adapter}' of frozen agents {agents} requires grad")
        if problems:
            raise RuntimeError(
                "The agents' adapters are not all training as configured: "
                + "; ".join(problems)
                + ". Something called PEFT's `set_adapter` (directly, or through `disable_adapter()` / TRL's "
                "`use_adapter`), which turns gradients off on every adapter but the active one, or built the "
                "optimizer from some adapters only. Route rows with `trainer.router` instead, and pass an optimizer "
                "over every trained adapter."
            )

    # ------------------------------------------------------------------ routing

    def _route_rows(self, agent_index: torch.Tensor | list[int]) -> None:
        """Route each row to its agent's adapter; a row of agent index `BASE_ROW` (-1) to the base model alone."""
        indices = agent_index.tolist() if isinstance(agent_index, torch.Tensor) else agent_index  # one device sync
        self.router.route([self.agent_adapters[i] if i != BASE_ROW else BASE for i in indices])

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs
    ):
        agent_index = self._rows_agent_index
        if agent_index is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kwargs
            )
        if len(agent_index) != input_ids.size(0):
            raise RuntimeError(
                f"{len(agent_index)} agent indices for {input_ids.size(0)} rows: rows lost their agents."
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = start + batch_size
            # The routing stays set after this call: gradient checkpointing replays this forward in the backward.
            self._route_rows(agent_index[start:end])
            chunk_logps, chunk_entropies, chunk_aux = super()._get_per_token_logps_and_entropies(
                model, input_ids[start:end], attention_mask[start:end], logits_to_keep, **kwargs
            )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
            aux_losses.append(chunk_aux)
        entropies = torch.cat(entropies) if entropies[0] is not None else None
        aux_loss = torch.stack(aux_losses).mean() if aux_losses[0] is not None else None
        return torch.cat(logps), entropies, aux_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self._check_adapters_train()
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def _compute_loss(self, model, inputs):
        self._rows_agent_index = inputs["agent_index"]
        loss = super()._compute_loss(model, inputs)
        if "num_real_rows" not in inputs:
            return loss
        # Padding rows out of the loss's normalisation: the real rows weigh as in a generation of them alone.
        is_padding = inputs["is_padding"]
        scale = padding_loss_scale(
            self.loss_type,
            rows=len(is_padding),
            real_rows=int((~is_padding).sum()),
            total_real_rows=int(inputs["num_real_rows"]),
            num_chunks=self.args.steps_per_generation if self.model.training else 1,
            num_processes=self.accelerator.num_processes,
        )
        return loss * scale if scale != 1.0 else loss

    def _clear_routing(self) -> None:
        self._rows_agent_index = None
        self.router.route(None)

    def training_step(self, model, inputs, num_items_in_batch):
        # The routing of a micro-batch must outlive its forward (checkpointing replays it in the backward) but not
        # the step: afterwards the model answers to `set_adapter` again.
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._clear_routing()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._clear_routing()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Each agent's adapter in PEFT format under `output_dir/<adapter>/`, the tokenizer, and `team.json` (agents,
        roles, turn settings, base model), which `trl_marl.load_team` reads. Checkpoints get the same."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            base = self.accelerator.unwrap_model(self.model).get_base_model()
            spec = team_spec(
                self.args, self.agent_adapters, base_model_name(base), self.transition, self.scheduler, self.task
            )
            write_team_file(output_dir or self.args.output_dir, spec)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        # Trainer reloads every adapter of a PeftModel but leaves only the active one trainable, and builds the
        # optimizer afterwards: without this, a resumed run would train a single agent (or a frozen one).
        unwrapped = self.accelerator.unwrap_model(model or self.model)
        self._set_adapter_trainability(unwrapped)
        self._adapter_parameters = adapter_parameters(unwrapped, self.adapter_names)

    # ------------------------------------------------------------------ rollout

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's share of the batch's episodes: MAGRPO trees."""
        return TreeRollout(
            agent_names=self.agent_names,
            num_generations=num_generations,
            num_turns=self.args.num_turns,
            joint_mode=self.joint_mode,
            discount=self.args.discount,
            termination_threshold=self.args.termination_threshold,
            reward_weights=self.reward_weights,
            baseline=self.baseline,
            scale_rewards=self.scale_rewards,
            transition=self.transition,
            agent_input=self._agent_input,
            process_index=self.accelerator.process_index,
            scheduler=self.scheduler,
            reset=self.task.reset if self.task is not None else None,
            step=self.task.step if self.task is not None else None,
        ).run(
            inputs,
            first_copy=self.accelerator.process_index * len(inputs),
            generate=functools.partial(self._generate_team, num_generations=num_generations),
            score=self._score_joint_actions,
            gather=self._gather,
        )

    @property
    def _gather(self) -> Callable[[list], list]:
        return gather_object if self.accelerator.num_processes > 1 else list

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rollout = self._rollout(inputs, num_generations)
        # Frozen agents' completions were scored (and are logged) but carry no loss. A process left without a trained
        # row keeps one frozen row, made loss-free below, for TRL's split.
        samples = [s for s in rollout.samples if s.agent in self.trained_agents] or rollout.samples[:1]
        no_loss = not any(s.agent in self.trained_agents for s in samples)
        device = self.accelerator.device
        output = self._pad_samples([s.prompt_ids for s in samples], [s.completion_ids for s in samples], no_loss)
        output["advantages"] = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device)
        if no_loss:
            output["advantages"].zero_()
        output["agent_index"] = torch.tensor([s.agent for s in samples], dtype=torch.long, device=device)
        output["turn_index"] = torch.tensor([s.turn for s in samples], dtype=torch.long, device=device)
        output["group_index"] = torch.tensor([s.group for s in samples], dtype=torch.long, device=device)
        output.update(self._reference_logps(output, mode))
        self._log_rollout_metrics(mode, rollout)
        self._log_local_rewards(mode, rollout.samples)
        self._log_joint_actions(mode, rollout.joint_actions)
        # Trees differ in size; TRL needs equal micro-batches (train) and equal row counts on every process (its loss
        # gathers per-row metrics). Rows are padded to the largest count over processes, rounded up to a multiple of
        # `steps_per_generation`, with loss-free copies (see `pad_rows`).
        # The loss then takes padding rows out of its normalisation (`_compute_loss`), from `num_real_rows`: the real
        # rows of every process.
        split = self.args.steps_per_generation if mode == "train" else 1
        rows = torch.tensor([[len(samples), 0 if no_loss else len(samples)]], device=device)
        rows = self.accelerator.gather(rows).view(-1, 2)
        num_rows = -(-rows[:, 0].max().item() // split) * split
        output = pad_rows(output, num_rows)
        output["num_real_rows"] = rows[:, 1].sum()
        return output

    def _agent_input(self, agent: int, prompt):
        return agent_prompt(self.args.agents[agent]["system_prompt"], prompt, self._use_chat_template)

    def _generate_team(self, model_inputs: list, agent_index: list[int], num_generations: int):
        """One `generate` call for rows of any agents, each row through its agent's adapter.

        TRL's `_generate` would gather its metrics over processes, which needs equal row counts; tree turns differ
        between processes, so generation metrics are logged once per rollout instead (`_log_rollout_metrics`).
        """
        self._route_rows(agent_index)
        try:
            prompt_ids, images, multimodal_fields = self._tokenize_prompts(model_inputs)
            self._check_prompt_lengths(prompt_ids, agent_index)
            completion_ids, _ = self._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations)
        finally:
            self._clear_routing()
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return [list(ids) for ids in prompt_ids], completion_ids, texts

    def _check_prompt_lengths(self, prompt_ids: list[list[int]], agent_index: list[int]) -> None:
        """A prompt that leaves no room for `max_completion_length` new tokens within the model's positions is an
        error naming the agent and quoting the prompt's end, before anything is generated or trained."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if not limit:
            return
        room = limit - self.max_completion_length
        for ids, agent in zip(prompt_ids, agent_index):
            if len(ids) > room:
                tail = self.processing_class.decode(ids[-40:], skip_special_tokens=True)
                raise ValueError(
                    f"Agent '{self.agent_names[agent]}' got a prompt of {len(ids)} tokens; with "
                    f"max_completion_length={self.max_completion_length} it exceeds the model's {limit} positions "
                    f"(max_position_embeddings). The prompt ends: ...{tail!r}. Filter out such rows (prompts of at "
                    f"most {room} tokens, system prompt and earlier turns included), or lower max_completion_length."
                )

    def _score_joint_actions(self, joint_actions: list[JointAction]) -> torch.Tensor:
        """`(J, F)` team rewards of this process's joint actions (not gathered: processes score different numbers).

        Reward functions get the dataset prompt, each joint action as a mapping agent -> text, and as kwargs the
        dataset columns, `completion_ids` (agent -> ids), `turn`, `history` (the earlier joint actions of the
        branch), `state` (AT-GRPO, when the task keeps one) and TRL's `trainer_state`, `log_extra`, `log_metric`.
        """
        if not joint_actions:
            return torch.zeros(0, len(self.reward_funcs))
        rows = [{**ja.branch.example, "turn": ja.turn, "history": list(ja.branch.history)} for ja in joint_actions]
        if any(ja.state is not None for ja in joint_actions):  # AT-GRPO with a task that keeps an environment state
            for row, ja in zip(rows, joint_actions):
                row["state"] = ja.state
        columns = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
        call = {key: [row[key] for row in rows] for key in columns}
        call.update(
            prompts=[row["prompt"] for row in rows],
            completions=[ja.completions for ja in joint_actions],
            completion_ids=[ja.completion_ids for ja in joint_actions],
            trainer_state=self.state,
            log_extra=self._log_completion_extra,
            log_metric=self._log_metric,
        )
        results = {}
        pending = []
        for index, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if is_async_callable(func):
                pending.append((index, func(**call)))
            else:
                with profiling_context(self, name):
                    results[index] = func(**call)
        if pending:

            async def run_all():
                return await asyncio.gather(*(coroutine for _, coroutine in pending))

            outputs = asyncio.run_coroutine_threadsafe(run_all(), self.async_loop).result()
            results.update({index: output for (index, _), output in zip(pending, outputs)})
        rewards = [[math.nan if r is None else float(r) for r in results[i]] for i in range(len(self.reward_funcs))]
        return torch.tensor(rewards, dtype=torch.float32).T.reshape(len(joint_actions), -1)

    def _pad_samples(self, prompt_ids_list, completion_ids_list, no_loss: bool = False) -> dict:
        device, pad_id = self.accelerator.device, self._tokenizer.pad_token_id

        def padded(sequences, value, side):
            tensors = [torch.tensor(s, dtype=torch.long) for s in sequences]
            return pad(tensors, padding_value=value, padding_side=side, pad_to_multiple_of=self.pad_to_multiple_of).to(
                device
            )

        prompt_ids = padded(prompt_ids_list, pad_id, "left")
        prompt_mask = padded([[1] * len(s) for s in prompt_ids_list], 0, "left")
        completion_ids = padded(completion_ids_list, pad_id, "right")
        completion_mask = padded([[1] * len(s) for s in completion_ids_list], 0, "right")
        if self.mask_truncated_completions:
            eos_and_pad = [*self.eos_token_ids, pad_id]
            is_truncated = torch.tensor([ids[-1] not in eos_and_pad for ids in completion_ids_list], device=device)
            completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()
        if no_loss:
            completion_mask = torch.zeros_like(completion_mask)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "num_items_in_batch": self.accelerator.gather(completion_mask.sum()).sum(),
        }

    def _reference_logps(self, samples: dict, mode: str) -> dict:
        """Old log-probs (when generation and optimisation steps are misaligned, as TRL) and, with `beta != 0`, the
        base model's log-probs (every row routed to the base: the shared reference of every agent)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        need_old = self.args.gradient_accumulation_steps % generate_every != 0
        if not need_old and self.beta == 0.0:
            return {}
        input_ids = torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1)
        attention_mask = torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1)
        logits_to_keep = samples["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        self._rows_agent_index = samples["agent_index"]
        logps = {}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if need_old:
                logps["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
            if self.beta != 0.0:
                self._rows_agent_index = torch.full_like(samples["agent_index"], BASE_ROW)
                logps["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
        self._clear_routing()
        return logps


class ATGRPOTrainer(MAGRPOTrainer):
    """AT-GRPO (arXiv 2510.11062): agent- and turn-wise groups with greedy continuation, on the same stack as
    [`MAGRPOTrainer`] (adapters, routing, loss, saving and metrics are shared; only the rollout differs).

    Each problem is one episode; at every turn the acting agents act in the scheduler's order, and for each of them
    `num_generations` candidates from the same state form a group, scored r = α · team reward + the agent's local
    reward (the task's `local_reward_funcs`); the episode continues from the best candidate. Tasks with an
    environment state implement `Task.reset` / `Task.step` (every branch holds its own copy). Takes the same arguments
    as [`MAGRPOTrainer`], with an [`ATGRPOConfig`].
    """

    _tag_names = ["trl", "trl-marl", "at-grpo"]
    _name = "AT-GRPO"
    _config_class = ATGRPOConfig

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's share of the batch's episodes: one greedy path per problem, one group per (problem, turn,
        agent)."""
        task = self.task
        return ATGRPORollout(
            agent_names=self.agent_names,
            num_generations=num_generations,
            num_turns=self.args.num_turns,
            reward_weights=self.reward_weights,
            team_reward_weight=self.args.team_reward_weight,
            continuation=self.args.continuation,
            baseline=self.baseline,
            scale_rewards=self.scale_rewards,
            transition=self.transition,
            agent_input=self._agent_input,
            scheduler=self.scheduler,
            reset=task.reset if task is not None else None,
            step=task.step if task is not None else None,
            success=task.success if task is not None else None,
            termination_threshold=self.args.termination_threshold,
            seed=self.args.seed * 1_000_003 + self.state.global_step,  # the same on every process
        ).run(
            inputs,
            first_copy=self.accelerator.process_index * len(inputs),
            generate=functools.partial(self._generate_team, num_generations=num_generations),
            score=self._score_joint_actions,
            local_score=self._local_scores,
            gather=self._gather,
        )

    def _local_scores(self, agent: int, joint_actions: list[JointAction]) -> list[float] | None:
        """The task's local rewards of the acting agent's candidates (None when it has none)."""
        if self.task is None or not joint_actions:
            return None
        name = self.agent_names[agent]
        rows = [ja.branch.example for ja in joint_actions]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        return local_rewards(
            self.task,
            name,
            [row["prompt"] for row in rows],
            [ja.completions[name] for ja in joint_actions],
            turn=[ja.turn for ja in joint_actions],
            state=[ja.state for ja in joint_actions],
            **columns,
        )

    def _log_local_rewards(self, mode: str, samples: list) -> None:
        """Local rewards are part of AT-GRPO's reward: the rollout already logs their mean per agent."""
