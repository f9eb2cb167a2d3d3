"""`TeamTrainer`: TRL's `GRPOTrainer` where each prompt is answered by a team of LoRA agents on one base model; the
base of [`MAGRPOTrainer`] (`magrpo_trainer.py`) and [`ATGRPOTrainer`] (`atgrpo_trainer.py`), which add their rollout.

This file is trl_marl's one seam with TRL: every method TRL or transformers calls that trl_marl overrides is here (the
checkpoint overrides in its mixin, `checkpoints.TeamCheckpoints`), each short, handing off to a collaborator the
trainer owns or to functions that take their inputs explicitly. Reading it tells what moves when the TRL pin moves
(docs/design.md, §10).

- `__init__`: the team's bases loaded (`team_assembly.load_team_models`); TRL's init, run without vLLM and with
  `beta=0`; then the parts around TRL's model (`team_assembly.assemble_parts`: the router, the captured decode step or
  the team's vLLM engine, `TeamGeneration`, `TeamScoring`, each base's `TeamBase`, the rollout settings).
- `_generate_and_score_completions`: the subclass's rollout (`_rollout`) with the collaborators' `generate` and
  `score` as hooks; one row per trained agent completion with `agent_index`, `turn_index`, `group_index`, padded with
  loss-free rows to what TRL's split needs (`rows.pad_rows`); the team's metrics (`metrics.py`).
- `_get_per_token_logps_and_entropies`, `_compute_loss`, `compute_loss`, `training_step`, `prediction_step`: each
  row's log-probs from its agent's adapter (the KL reference from the base), the padding scale, the adapter check.
- `train`, `_save_checkpoint`, `_load_rng_state`, `_get_train_sampler`, `_load_from_checkpoint`, `_load_best_model`:
  complete checkpoints, exact resume, every agent's adapter reloaded (`checkpoints.TeamCheckpoints`, a mixin).
- `save_model`, `create_model_card`, `_push_from_checkpoint`: the whole team saved and shared (`sharing.py`).
Everything else (loss types, clipping, KL to the base, gradient accumulation, logging) is TRL's.
"""

import contextlib
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset
from transformers import PreTrainedTokenizerBase, TrainerCallback
from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving
from trl.models.utils import disable_gradient_checkpointing

from ..agents import check_adapters_train
from ..config import TeamConfig
from ..generation.routing import BASE_ROW
from ..generation.team_generation import captured_single_turn
from ..generation.tool_calling import check_tool_settings, prepare_tool_tokenizer
from ..memory.host import ReleaseFreeMemory, release_free_memory
from ..rollouts.rollout import Rollout, Sample, default_transition
from ..rollouts.rows import pad_rows, pad_samples, padding_loss_scale, tool_masks
from ..rollouts.scheduling import resolve_scheduler, scheduled_phases
from ..team.base_generation import generate_by_base, logps_by_base
from ..team.bases import first_base_alone, save_base_adapters
from ..team.hub import CARD_FILE, write_local_bases
from ..team.saved import local_base_paths
from .checkpoints import TeamCheckpoints
from .metrics import log_joint_actions, log_rollout_metrics
from .reward_checks import TeamRewardFunc
from .sharing import card_example, card_settings, push_team_files, save_team, team_card, trained_team_spec
from .team_assembly import assemble_parts, check_team_training, load_team_models
from .team_inputs import resolve_team_inputs

logger = logging.getLogger("trl_marl")


class TeamTrainer(TeamCheckpoints, GRPOTrainer):
    """What [`MAGRPOTrainer`] and [`ATGRPOTrainer`] share: TRL's [`~trl.GRPOTrainer`] with a team of LoRA agents on
    one base model. A subclass supplies `_rollout` (its algorithm's episodes) and its config class.

    Args:
        model: a model id or local path, a loaded `PreTrainedModel` (adapters are added, one per agent), or a
            `PeftModel` that already carries one adapter per agent (named after the agents).
        reward_funcs: team reward function(s) or reward plugin names; a function is
            `f(prompts, completions, **kwargs) -> list[float | None]`, where each
            completion is a mapping agent name -> text and kwargs carry the dataset columns, `completion_ids` (a
            mapping agent name -> token ids), `turn`, `history` (the branch's earlier joint actions) and TRL's
            `trainer_state`, `log_extra`, `log_metric`.
        args: the trainer's config (a [`MAGRPOConfig`] or [`ATGRPOConfig`]; it names the agents).
        quantization_config: e.g. a 4-bit `BitsAndBytesConfig`, used when `model` is an id or path.
        peft_config: a `LoraConfig` for every agent's adapter; defaults to one built from the `lora_*` fields.
        transition: with `num_turns > 1`, what each agent sees at the next turn of one branch:
            `f(prompt, joint_action, history, turn, observations, reward, **columns)` returns one prompt per agent (a
            list, or a dict agent name -> prompt) or `NextTurn(prompts, done)`; see [`~trl_marl.NextTurn`].
            Defaults to [`~trl_marl.default_transition`]: the task prompt again (the scheduler adds what was
            said).
        scheduler: a scheduler object or plugin name overriding `args.scheduler` (see `trl_marl.rollouts.scheduling`).
        task: a [`~trl_marl.Task`] or task plugin name; it supplies the reward functions, training data and transition
            when those are not given (build `args` with the config's `for_task` to take its agents and turns too).
        base_models: loaded models for agents' own `model` names (name -> model), used as given instead of loading
            them: a `PeftModel` carrying exactly its agents' adapters, as `evaluate_task` passes a saved team's bases.
        The other arguments are TRL's.
    """

    _config_class: type[TeamConfig] = TeamConfig
    _resumed_epoch = 0  # the epoch a resumed `train()` continues in (`_get_train_sampler`)

    def __init__(
        self,
        model,
        reward_funcs: TeamRewardFunc | str | list[TeamRewardFunc | str] | None = None,
        args: TeamConfig | None = None,
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
        base_models: dict | None = None,
        tools: list[Callable] | None = None,
        environment_factory: Callable | None = None,
    ):
        config_class = self._config_class
        if not config_class._trainer:
            raise TypeError(
                f"{type(self).__name__} is a base the trainers share: use MAGRPOTrainer, ATGRPOTrainer, IACTrainer or "
                "MAACTrainer."
            )
        if not isinstance(args, config_class):
            other = ""
            if isinstance(args, TeamConfig) and args._trainer:  # the sibling algorithm's config
                name = type(args).__name__
                other = f"; {'an' if name[0] in 'AEIOU' else 'a'} {name} goes to {args._trainer}"
            raise TypeError(
                f"`args` must be a {config_class.__name__} naming the agents, got {type(args).__name__}{other}, e.g. "
                f"{config_class.__name__}(output_dir='out', agents=['concise', 'detailed'])."
            )
        task, reward_funcs, train_dataset, eval_dataset, transition = resolve_team_inputs(
            args, task, reward_funcs, train_dataset, eval_dataset, transition, environment_factory is not None
        )
        self.task = task
        if environment_factory is None:  # a task's own environment (`tasks.math_tool_calls`)
            environment_factory = getattr(task, "environment_factory", None)
        self.transition = transition or default_transition
        # Resolved and checked before any model loads: an unknown or broken scheduler plugin, or phases that list an
        # agent twice in a turn, fail here.
        self.scheduler = resolve_scheduler(scheduler if scheduler is not None else args.scheduler)
        scheduled_phases(self.scheduler, args.num_agents, args.num_turns)

        # The team's bases: one, unless agents name their own `model` (`team/bases.py`); checked before any loads,
        # then each loaded once with its agents' adapters (`team_assembly.py`).
        team = load_team_models(args, model, quantization_config, base_models, processing_class, peft_config)
        self.agent_names, self.agent_adapters, self.agent_base = args.agent_names, team.agent_adapters, team.agent_base
        self.adapter_names = team.adapter_names
        # Frozen agents act but do not train: their adapters (unless shared with a trained agent) get no gradient,
        # so the optimizer, built from what requires grad, never holds them.
        self.trained_agents, self.trained_adapters = team.trained_agents, team.trained_adapters
        self._set_adapter_trainability(team.models)
        model = team.models[0]

        if args.ddp_find_unused_parameters is None and len(self.adapter_names) > 1:
            # A micro-batch may hold rows of only some agents; the other adapters then get no gradient under DDP.
            args.ddp_find_unused_parameters = True

        # TRL would clone an adapter named "default" as the KL reference when given a PeftModel with beta != 0; with
        # fresh adapters the base model (adapters disabled) is every agent's reference, which TRL uses when no "ref"
        # adapter exists. model_init_kwargs were used above; TRL would warn that they are ignored. TRL's own vLLM
        # engine would serve one policy: the team's engine is built below instead, so TRL's init runs without vLLM.
        beta, model_init_kwargs, use_vllm = args.beta, args.model_init_kwargs, args.use_vllm
        calls_tools = bool(tools or environment_factory or any(agent.get("tools") for agent in args.agents))
        if calls_tools:  # the base renders tools and reads calls back before TRL's init looks (`tool_templates`)
            check_tool_settings(args, environment_factory, len(team.plans), getattr(self, "episode", None))
            processing_class = prepare_tool_tokenizer(processing_class, model, args)
        args.beta, args.model_init_kwargs, args.use_vllm = 0.0, None, False
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
                tools=tools,
                environment_factory=environment_factory,
            )
        finally:
            args.beta, args.model_init_kwargs, args.use_vllm = beta, model_init_kwargs, use_vllm
        self.add_callback(ReleaseFreeMemory())  # the resident set between steps is the live memory (`memory.host`)
        if calls_tools and not self.tools and not is_chat_template_prefix_preserving(self.processing_class):
            # agents' own tools only: what TRL does for `tools=`, so the loop's suffixes follow the rendering
            self.chat_template = get_training_chat_template(self.processing_class)
        self._team_tools = (tools, environment_factory) if calls_tools else None
        self.beta, self.use_vllm = beta, use_vllm

        deepspeed_plugin = self.accelerator.state.deepspeed_plugin
        zero3 = deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3
        sharding = "FSDP" if self.is_fsdp_enabled else "DeepSpeed ZeRO-3" if zero3 else None
        extra_loss_terms = self._entropy_bonus_enabled or self.aux_loss_enabled
        check_team_training(args, len(self.adapter_names), sharding, self.loss_type, extra_loss_terms)
        self.num_agents = args.num_agents
        self.baseline = args.baseline
        self._rows_agent_index: torch.Tensor | None = None
        self._rows_base: torch.Tensor | None = None  # each row's base, when its agent index says the base model alone
        # The router, decode step or vLLM engine, generation, scoring and bases around TRL's model (`team_assembly`).
        parts = assemble_parts(self, team, use_vllm, sharding)
        self.router, self._adapter_parameters = parts.router, parts.adapter_parameters
        self.captured_decoder, self.sampling_correction = parts.captured_decoder, parts.sampling_correction
        if use_vllm:
            self.vllm_generation = parts.vllm_generation
            self._last_loaded_step = -1  # as TRL: adapters are sent at the first generation of a step
        self.team_generation, self.scoring, self.bases = parts.team_generation, parts.scoring, parts.bases
        self.rollout_settings = parts.rollout_settings

    def _base_adapters(self, base_index: int) -> list[str]:
        """The adapters of the agents on one base, each once."""
        agents = [i for i, base in enumerate(self.agent_base) if base == base_index]
        return list(dict.fromkeys(self.agent_adapters[i] for i in agents))

    def _set_adapter_trainability(self, models) -> None:
        """Trained adapters require grad, frozen ones do not, on each base's `PeftModel`. Set at creation and after a
        checkpoint reload (which leaves only PEFT's active adapter trainable); the optimizer is built from what
        requires grad."""
        for index, model in enumerate(models):
            adapters = self._base_adapters(index)
            trained = [name for name in adapters if name in self.trained_adapters]
            frozen = [name for name in adapters if name not in self.trained_adapters]
            if trained:
                model.set_requires_grad(trained, requires_grad=True)
            if frozen:
                model.set_requires_grad(frozen, requires_grad=False)

    def adapters_changed(self) -> None:
        """Call after changing the agents' adapters outside the trainer (one agent warm-started with TRL's
        `SFTTrainer`, weights loaded by hand): trained adapters take gradients again and frozen ones do not (PEFT's
        `set_adapter` leaves gradients only on the adapter it activates), and the vLLM engine is sent the new weights
        at its next generation. The captured decode step reads the adapters at every call and needs nothing."""
        self._set_adapter_trainability([base.model for base in self.bases])
        self._serve_loaded_adapters()

    def _check_adapters_train(self) -> None:
        """Every trained agent's adapter trains, frozen ones do not (`agents.check_adapters_train`): checked before
        every loss, a few hundred flag reads."""
        flattened = self.is_deepspeed_enabled or self.is_fsdp_enabled
        optimizer = None if flattened else getattr(self, "optimizer", None)
        check_adapters_train(
            self._adapter_parameters, self.agent_names, self.agent_adapters, self.trained_adapters, optimizer
        )

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's, except that text generated without vLLM goes through the team's captured decode step
        (`captured_decode`)."""
        if self.captured_decoder is None or images is not None or multimodal_fields:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        return captured_single_turn(self, self.captured_decoder, prompt_ids)

    # ------------------------------------------------------------------ routing

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
        if len(self.bases) == 1:
            return self._routed_logps(
                model,
                self.team_generation,
                agent_index,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                **kwargs,
            )
        base_of_row = self._rows_base if self._rows_base is not None else self._agent_base_of(agent_index)
        return logps_by_base(
            self.bases,
            base_of_row,
            agent_index,
            input_ids,
            attention_mask,
            # the first base is the model TRL passed (it may be wrapped), the others their own PeftModels
            lambda index, base, *args, **kwargs: self._routed_logps(
                model if index == 0 else base.model, base.generation, *args, **kwargs
            ),
            logits_to_keep,
            batch_size,
            **kwargs,
        )

    def _routed_logps(
        self, model, generation, agent_index, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
    ):
        """TRL's log-probs and entropies of one base's rows, in chunks of `batch_size`, each row through its agent's
        adapter (`generation.route`)."""
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = start + batch_size
            # The routing stays set after this call: gradient checkpointing replays this forward in the backward.
            generation.route(agent_index[start:end])
            chunk_logps, chunk_entropies, chunk_aux = super()._get_per_token_logps_and_entropies(
                model, input_ids[start:end], attention_mask[start:end], logits_to_keep, **kwargs
            )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
            aux_losses.append(chunk_aux)
        entropies = torch.cat(entropies) if entropies[0] is not None else None
        aux_loss = torch.stack(aux_losses).mean() if aux_losses[0] is not None else None
        return torch.cat(logps), entropies, aux_loss

    def _agent_base_of(self, agent_index: torch.Tensor) -> torch.Tensor:
        """The base index of each row's agent."""
        return torch.tensor(self.agent_base, device=agent_index.device)[agent_index]

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
        self._rows_agent_index = self._rows_base = None
        for base in self.bases:
            base.router.route(None)

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
        """Each agent's adapter in PEFT format under `output_dir/<adapter>/`, the tokenizer, `team.json` (agents,
        roles, turn settings, base model), which `trl_marl.load_team` reads, the team's model card (`sharing.py`),
        and this machine's paths of its local bases (`hub.write_local_bases`). Checkpoints get the same."""
        with first_base_alone(self.bases[0].model):
            super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            folder = output_dir or self.args.output_dir
            for index, base in enumerate(self.bases[1:], start=1):  # Trainer saved the first base's; each other's
                save_base_adapters(folder, base, self._base_adapters(index))
            spec = self._team_spec()
            save_team(folder, spec, self.adapter_names, self._team_card(spec, folder))
            write_local_bases(folder, local_base_paths([base.model.get_base_model() for base in self.bases]))

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """The team's model card in `output_dir/README.md` (TRL's hook, with TRL's arguments)."""
        if self.is_world_process_zero():
            card = self._team_card(self._team_spec(), self.args.output_dir, model_name, dataset_name, tags)
            card.save(Path(self.args.output_dir) / CARD_FILE)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Trainer copies only top-level model files into `output_dir` before it uploads it: the team's adapter
        # folders, `team.json` and card go too.
        if self.is_world_process_zero():
            in_progress = getattr(self, "push_in_progress", None)
            push_team_files(checkpoint_folder, self.args.output_dir, self.adapter_names, self.args, in_progress)
        super()._push_from_checkpoint(checkpoint_folder)

    def _team_spec(self) -> dict:
        base = self.accelerator.unwrap_model(self.model).get_base_model()
        others = [other.model.get_base_model() for other in self.bases[1:]]
        loadings = [other.loading for other in self.bases[1:]]
        return trained_team_spec(
            base, self.args, self.agent_adapters, self.rollout_settings, self.task, others, self.agent_base, loadings,
            team_tools=self._team_tools,
        )  # fmt: skip

    def _team_card(self, spec: dict, folder, model_name=None, dataset_name=None, tags=None):
        lora = self.accelerator.unwrap_model(self.model).peft_config[self.adapter_names[0]]
        settings = card_settings(
            spec,
            self.args,
            lora,
            reward_func_names=self.reward_func_names,
            loss_type=self.loss_type,
            beta=self.beta,
            global_step=self.state.global_step,
        )
        return team_card(
            spec,
            folder,
            args=self.args,
            state=self.state,
            hub_model_id=getattr(self, "hub_model_id", None),
            trainer_name=type(self).__name__,
            paper=self._paper,
            tag_names=self._tag_names,
            settings=settings,
            example=card_example(self.train_dataset),
            model_name=model_name,
            dataset_name=dataset_name,
            tags=tags,
        )

    # ------------------------------------------------------------------ rollout

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's share of the batch's episodes (`inputs`: its prompt copies), scored, with advantages."""
        raise NotImplementedError(f"{type(self).__name__} must implement `_rollout`.")

    def _rollout_hooks(self, inputs: list[dict], num_generations: int) -> dict:
        """What every rollout's `run` takes from the trainer: the layout of this process's copies and the model."""
        return {
            "first_copy": self.accelerator.process_index * len(inputs),
            "generate": (
                functools.partial(self.team_generation.generate, num_generations=num_generations)
                if len(self.bases) == 1
                else functools.partial(generate_by_base, self.bases, self.agent_base, num_generations=num_generations)
            ),
            "score": self.scoring.score,
            "gather": gather_object if self.accelerator.num_processes > 1 else list,
        }

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        release_free_memory()  # what the last loss freed, back to the system before generation (`memory.host`)
        rollout = self._rollout(inputs, num_generations)
        for base in self.bases:
            if base.decoder is not None:
                base.decoder.release()  # the static caches' memory goes back to training
        release_free_memory()  # and what generation freed (its threads' arenas included) before the loss
        # Frozen agents' completions were scored (and are logged) but carry no loss. A process left without a trained
        # row keeps one frozen row, made loss-free below, for TRL's split.
        trained = [s for s in rollout.samples if s.agent in self.trained_agents]
        no_loss = not trained
        # (A program rollout whose every episode failed on this process has no row at all: one loss-free stand-in.)
        samples = trained or rollout.samples[:1] or [self._stand_in_sample()]
        if not rollout.samples and self.sampling_correction is not None:  # no sampler's log-probs: a ratio of 1
            self.sampling_correction.record([0], [samples[0].prompt_ids], [samples[0].completion_ids], [[None]])
        device = self.accelerator.device
        output = self._pad_samples(
            [s.prompt_ids for s in samples], [s.completion_ids for s in samples], no_loss, [s.agent for s in samples]
        )
        # Tool results' tokens out of the loss, as TRL masks them. Every process of a trainer with tools joins the
        # count, rows of tools or not (a process may hold none this step: a later turn's agent, an early end).
        if self._team_tools is not None:
            output["tool_mask"] = tool_masks(samples, self.pad_to_multiple_of, device)
            loss_tokens = (output["completion_mask"] * output["tool_mask"]).sum()
            output["num_items_in_batch"] = self.accelerator.gather(loss_tokens).sum()
        if self.team_generation.tool_calling is not None:
            for name, value in self.team_generation.tool_calling.take_metrics(self.agent_names).items():
                self._metrics[mode][name].append(value)
        output["advantages"] = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device)
        if no_loss:
            output["advantages"].zero_()
        output["agent_index"] = torch.tensor([s.agent for s in samples], dtype=torch.long, device=device)
        output["turn_index"] = torch.tensor([s.turn for s in samples], dtype=torch.long, device=device)
        output["group_index"] = torch.tensor([s.group for s in samples], dtype=torch.long, device=device)
        output.update(self._reference_logps(output, mode))
        if self.sampling_correction is not None:  # vLLM sampled the rows: TRL's importance-sampling correction
            output.update(
                self.sampling_correction.outputs(samples, output, self._metrics[mode], self.accelerator.gather)
            )
        log_rollout_metrics(
            self._metrics[mode],
            rollout,
            agent_names=self.agent_names,
            reward_func_names=self.reward_func_names,
            reward_weights=self.reward_weights,
            eos_and_pad=[self._completion_stops(base) for base in self.agent_base],
            num_turns=self.args.num_turns,
            state=self.state,
            mode=mode,
            num_processes=self.accelerator.num_processes,
        )
        log_joint_actions(
            self._logs,
            self._metrics[mode],
            self._pending_extra_logs,
            self._pending_metrics,
            rollout.joint_actions,
            reward_func_names=self.reward_func_names,
            num_turns=self.args.num_turns,
            accelerator=self.accelerator,
        )
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

    def _stand_in_sample(self) -> Sample:
        """A one-token row of the first agent that carries no loss (`no_loss`), for a process without any row."""
        tokenizer = self._tokenizer
        return Sample(0, (0, -1, -1), 0, 0, "", [tokenizer.pad_token_id], [self.eos_token_ids[0]], "")

    def _completion_stops(self, base_index: int) -> list[int]:
        """The tokens that end a completion on a base: its EOS tokens and its padding."""
        base = self.bases[base_index]
        return [*base.eos_token_ids, base.pad_token_id]

    def _pad_samples(self, prompt_ids_list, completion_ids_list, no_loss: bool = False, agents=None) -> dict:
        eos_token_ids = self.eos_token_ids if self.mask_truncated_completions else None
        if eos_token_ids is not None and len(self.bases) > 1:  # each row ends with its own base's EOS or padding
            eos_token_ids = [self._completion_stops(self.agent_base[agent]) for agent in agents]
        output = pad_samples(
            prompt_ids_list,
            completion_ids_list,
            pad_id=self._tokenizer.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            device=self.accelerator.device,
            eos_token_ids=eos_token_ids,
            no_loss=no_loss,
        )
        output["num_items_in_batch"] = self.accelerator.gather(output["completion_mask"].sum()).sum()
        return output

    def _reference_logps(self, samples: dict, mode: str) -> dict:
        """Old log-probs (when generation and optimisation steps are misaligned, as TRL) and, with `beta != 0`, the
        base model's log-probs (every row routed to the base: the shared reference of every agent)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        need_old = self.args.gradient_accumulation_steps % generate_every != 0 or self.sampling_correction is not None
        if not need_old and self.beta == 0.0:
            return {}
        input_ids = torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1)
        attention_mask = torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1)
        logits_to_keep = samples["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        self._rows_agent_index = samples["agent_index"]
        logps = {}
        with torch.no_grad(), contextlib.ExitStack() as no_checkpointing:
            for model in [self.model, *(base.model for base in self.bases[1:])]:  # every base recomputes nothing
                no_checkpointing.enter_context(
                    disable_gradient_checkpointing(model, self.args.gradient_checkpointing_kwargs)
                )
            if need_old:
                logps["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
            if self.beta != 0.0:
                self._rows_base = self._agent_base_of(samples["agent_index"])  # each row's reference: its own base
                self._rows_agent_index = torch.full_like(samples["agent_index"], BASE_ROW)
                logps["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
        self._clear_routing()
        return logps
