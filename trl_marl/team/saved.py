"""The trained team as an artefact: `team.json` beside the agents' PEFT adapters, and `load_team` to run it.

A trainer's `save_model(out)` (`MAGRPOTrainer`, `ATGRPOTrainer`) writes `out/<adapter>/` (PEFT format, one folder
per agent, or `out/team/` when the agents share an adapter), the tokenizer, and `out/team.json`:

```json
{"format": "trl_marl.team/1", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
 "agents": [{"name": "planner", "system_prompt": "...", "adapter": "planner"}, ...],
 "num_turns": 2, "transition": "trl_marl.rollouts.rollout:default_transition", "max_completion_length": 64, ...}
```

`load_team(out)` (the folder, or the Hub id of a pushed team) rebuilds the team on its base model (optionally 4-bit),
or its base models when agents trained on their own, and `Team.run(prompt)` plays an episode with the prompt building
of training: each agent gets its role and what the transition shows it, nothing else.

`team.json` names each base as another machine can use it: its Hub id, else its local folder's name (`./<folder>`);
the machine that saved the team keeps its local bases' paths beside it (`hub.LOCAL_BASES_FILE`), in a file that
Trainer's uploads of the team leave out; the checkpoint folders that `hub_strategy="checkpoint"` or
`"all_checkpoints"` uploads go whole, that file included.
"""

import functools
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import BitsAndBytesConfig

from ..agents import agent_prompt
from ..config import ATGRPOConfig
from ..generation.captured_decode import captured_decoder
from ..generation.routing import AdapterRouter
from ..generation.team_generation import left_padded, position_limit
from ..generation.tool_calling import ToolCalling, ToolLoop, ToolRow, episode_environments
from ..registry import PluginError
from ..rollouts.magrpo_rollout import TreeRollout
from ..rollouts.rollout import RolloutSettings, default_transition
from ..rollouts.scheduling import Prompt, resolve_scheduler
from ..tasks import resolve_task
from .base_generation import tokenize_text_prompts
from .bases import spec_bases
from .default_model import is_default_model
from .hub import TEAM_FILE, portable_base_name, resolve_team_folder
from .importable import import_by_name, importable_name
from .saved_bases import load_saved_bases
from .saved_tools import SavedTools, agent_tools_record, saved_tool_calling, saved_tools, tools_record

logger = logging.getLogger("trl_marl")

TEAM_FORMAT = "trl_marl.team/1"
# How the team sampled in training and in the trainer's evaluation (config fields of these names), recorded in
# team.json so that `trl-marl evaluate` samples the same way by default (and runs as many tool-calling rounds).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_FIELDS = ("max_completion_length", *SAMPLING_FIELDS, "chat_template_kwargs", "max_tool_calling_iterations")


def base_model_name(model: Any) -> str:
    """A loaded base model's name in `team.json` and its adapters' configs, one another machine can use
    (`hub.portable_base_name`): its Hub id (the locally converted default model's too), else its local folder's name
    as `./<folder>`, never its path on this machine."""
    return portable_base_name(getattr(model.config, "_name_or_path", "") or "")


def local_base_paths(models: Sequence[Any]) -> dict[str, str]:
    """Where this machine keeps the loaded base `models` that `team.json` names otherwise than they were loaded (a
    local folder, a Hub cache snapshot), by their recorded names: what `hub.write_local_bases` keeps beside a saved
    team, so that `load_team` finds them here."""
    paths = {}
    for model in models:
        loaded_from = getattr(model.config, "_name_or_path", "") or ""
        if os.path.isdir(loaded_from) and not is_default_model(loaded_from):
            paths[base_model_name(model)] = loaded_from
    return paths


def team_spec(
    args: Any,
    adapters: list[str],
    base_model: str,
    transition: Callable,
    scheduler: Any,
    task: Any = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable | None = None,
) -> dict:
    """The contents of `team.json` for a trainer's configuration, with the trainer's `tools=` and the environment
    factory its episodes used (`saved_tools.tools_record`)."""
    return {
        "format": TEAM_FORMAT,
        "algorithm": "AT-GRPO" if isinstance(args, ATGRPOConfig) else "MAGRPO",
        "base_model": base_model,
        "agents": [
            {**agent, **agent_tools_record(agent), "adapter": adapter} for agent, adapter in zip(args.agents, adapters)
        ],
        "adapter_mode": args.adapter_mode,
        "num_turns": args.num_turns,
        "joint_mode": getattr(args, "joint_mode", "aligned"),  # AT-GRPO's are MAGRPO's defaults
        "discount": getattr(args, "discount", 1.0),
        "termination_threshold": args.termination_threshold,
        "task": getattr(task, "name", None) or None,  # a task plugin: its transition is rebuilt from it
        "transition": importable_name(transition),
        "scheduler": getattr(scheduler, "name", None) or args.scheduler,
        "max_completion_length": args.max_completion_length,
        **{name: getattr(args, name) for name in SAMPLING_FIELDS},
        "chat_template_kwargs": dict(args.chat_template_kwargs or {}),
        "max_tool_calling_iterations": args.max_tool_calling_iterations,
        **tools_record(tools, environment_factory),
    }


def write_team_file(folder: str | os.PathLike, spec: dict) -> None:
    path = Path(folder) / TEAM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2) + "\n")


@dataclass
class TeamRun:
    """One episode: per turn, what each acting agent was shown (its role included) and what it answered; every
    agent's latest answer (what the team reward scores), the task's final environment state (None without one) and
    the episode's environment (`environment_factory=` in training) as its tool calls left it (None without one)."""

    observations: list[dict[str, Prompt]]
    turns: list[dict[str, str]]
    latest: dict[str, str] | None = None
    state: Any = None
    environment: Any = None

    @property
    def final(self) -> dict[str, str]:
        return self.turns[-1]


@dataclass
class BasePart:
    """One base of a loaded team: its `PeftModel` (the adapters of its agents), tokenizer, agents (indices), router
    (None for one adapter) and captured decoder (None for eager `generate`)."""

    model: PeftModel
    tokenizer: Any
    agents: list[int]
    router: AdapterRouter | None = None
    decoder: Any = None


class Team:
    """A trained team on one base model, or on several (`other_bases`: `(model, tokenizer, agent indices)` of each
    base after the first): `run(prompt)` plays one episode (greedy by default), every agent's rows of a turn in one
    generation call per base, each through its own adapter: transformers' routed `generate` (through the captured
    decode step where `captured_decode` chooses it, `trl_marl.generation.captured_decode`), or with `engine` (a
    `SavedTeamEngine`, `load_team(..., use_vllm=True)`) one vLLM call with one LoRA request per row. A team that
    trained with tools plays with them as it trained: each agent's prompts render its tools, its calls run in TRL's
    tool loop (`tool_calling.ToolLoop`), one environment per episode, no sequence reaching `max_model_length` (the
    first base's positions when None; `load_team` gives vLLM's `vllm_max_model_length` when smaller, as training).
    `tools` rebuilds them (`load_team` gives `saved_tools.saved_tools` with its arguments): called when the team first
    plays (`run`, `play`), never by serving, whose clients send their own tools, so a team is served on a machine
    that cannot rebuild them, and its environment is never made there."""

    def __init__(
        self,
        model: PeftModel,
        tokenizer: Any,
        spec: dict,
        transition: Callable,
        scheduler: Any,
        task: Any = None,
        engine: Any = None,
        captured_decode: bool | str | None = None,
        other_bases: list[tuple] = (),
        tools: Callable[[], SavedTools] | None = None,
        max_model_length: int | None = None,
    ):
        self.model, self.tokenizer, self.spec, self.transition = model, tokenizer, spec, transition
        self.scheduler = scheduler
        self.engine = engine
        self.task = task  # the task plugin it was trained on, when loadable: its environment state, if any
        self.agents = spec["agents"]
        self.agent_names = [agent["name"] for agent in self.agents]
        self._adapters = [agent["adapter"] for agent in self.agents]
        on_others = {agent for _, _, agents in other_bases for agent in agents}
        first = [index for index in range(len(self.agents)) if index not in on_others]
        self.bases = [
            self._base(part_model, part_tokenizer, agents, engine, captured_decode)
            for part_model, part_tokenizer, agents in [(model, tokenizer, first), *other_bases]
        ]
        self.agent_base = [0] * len(self.agents)
        for index, base in enumerate(self.bases):
            for agent in base.agents:
                self.agent_base[agent] = index
        self.router, self.decoder = self.bases[0].router, self.bases[0].decoder
        # Every agent is given its role as training gave it: as a conversation when its base's tokenizer has a chat
        # template (the first base's decides, as in the trainer's rollouts).
        self._use_chat_template = getattr(tokenizer, "chat_template", None) is not None
        if max_model_length is None:
            max_model_length = getattr(model.config, "max_position_embeddings", None)
        self.max_model_length = max_model_length
        self._rebuild_tools = tools
        self._tool_calling, self._environment_factory = None, None

    @property
    def tool_calling(self) -> ToolCalling | None:
        """The team's tools as it trained with them (None without any), rebuilt when first asked for."""
        self._rebuild_trained_tools()
        return self._tool_calling

    @property
    def environment_factory(self) -> Callable | None:
        """The factory of each episode's environment (None without one), rebuilt when first asked for."""
        self._rebuild_trained_tools()
        return self._environment_factory

    def _rebuild_trained_tools(self) -> None:
        """Rebuild the tools and environment the team trained with, once. Raises what `saved_tools.saved_tools`
        raises (an `UnrebuiltTool` naming a tool or factory that cannot be rebuilt here and what to pass)."""
        if self._rebuild_tools is None:
            return
        tools = self._rebuild_tools()
        if tools.calls_tools:
            if len(self.bases) > 1:  # as the trainers refuse it (`tool_calling.check_tool_settings`)
                raise ValueError("Tools are not supported on a team of several base models.")
            self._tool_calling = saved_tool_calling(tools, self.spec, self.tokenizer, self.max_model_length)
            self._environment_factory = tools.environment_factory
        self._rebuild_tools = None

    def _base(self, model, tokenizer, agents: list[int], engine, captured_decode) -> BasePart:
        adapters = list(dict.fromkeys(self._adapters[agent] for agent in agents))
        if len(adapters) > 1:
            router = AdapterRouter(model, adapters)
        else:
            router = None
            model.set_adapter(adapters[0])
        decoder = captured_decoder(model, router, captured_decode) if engine is None else None
        return BasePart(model, tokenizer, agents, router, decoder)

    def run(
        self,
        prompt: Prompt,
        num_turns: int | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool = False,
        **columns,
    ) -> TeamRun:
        """Play one episode on `prompt` (a string or chat messages, as in the training data) for `num_turns` turns
        (default: as trained). `columns` are the extra dataset columns the transition reads (e.g. tests)."""
        return self.play([{**columns, "prompt": prompt}], num_turns, max_new_tokens, do_sample)[0]

    def play(
        self,
        rows: list[dict],
        num_turns: int | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool = False,
    ) -> list[TeamRun]:
        """Play one episode per dataset row (its `prompt` and the columns the task reads), all rows' agents of a turn
        in one generation call; an episode ends early when the transition says it is done."""
        if not rows:
            return []
        max_new_tokens = max_new_tokens or self.spec["max_completion_length"]
        settings = RolloutSettings(
            agent_names=self.agent_names,
            num_turns=num_turns or self.spec["num_turns"],
            reward_weights=torch.ones(1),
            baseline="none",
            scale_rewards="none",
            transition=self.transition,
            scheduler=self.scheduler,
            reset=self.task.reset if self.task is not None else None,
            step=self.task.step if self.task is not None else None,
            agent_input=lambda agent, task: agent_prompt(
                self.agents[agent]["system_prompt"], task, self._use_chat_template
            ),
            environment=episode_environments(self.environment_factory) if self.environment_factory else None,
        )

        def generate(inputs, agent_index, environments=None):
            return self._generate(inputs, agent_index, max_new_tokens, do_sample, environments)

        rollout = TreeRollout(settings, num_generations=1).run(
            [dict(row) for row in rows],
            first_copy=0,
            generate=generate,
            score=lambda joint_actions: torch.full((len(joint_actions), 1), math.nan),
        )
        # With one generation per node each row is one path: a joint action continues its parent's (`branch.parent`),
        # and a later node's key ends with the index of the joint action it continues.
        row_of = []
        for joint_action in rollout.joint_actions:
            row_of.append(joint_action.node[2] if joint_action.turn == 0 else row_of[joint_action.branch.parent])
        paths = [[ja for ja, row in zip(rollout.joint_actions, row_of) if row == index] for index in range(len(rows))]
        observations = [[{} for _ in path] for path in paths]
        for sample in rollout.samples:
            row = sample.node[2] if sample.turn == 0 else row_of[sample.node[2]]
            observations[row][sample.turn][self.agent_names[sample.agent]] = sample.model_input
        runs = [
            TeamRun(
                seen, [dict(ja.said) for ja in path], dict(path[-1].completions), path[-1].state, path[-1].environment
            )
            for seen, path in zip(observations, paths)
        ]
        return runs

    @torch.no_grad()
    def _generate(
        self, model_inputs: list, agent_index: list[int], max_new_tokens: int, do_sample: bool, environments=None
    ):
        """Per row: prompt ids, completion ids and text, each base's rows in one call, back in row order."""
        if len(self.bases) == 1:
            return self._generate_on(self.bases[0], model_inputs, agent_index, max_new_tokens, do_sample, environments)
        results = [None] * len(agent_index)
        for index, base in enumerate(self.bases):
            rows = [row for row, agent in enumerate(agent_index) if self.agent_base[agent] == index]
            if rows:
                inputs, agents = [model_inputs[row] for row in rows], [agent_index[row] for row in rows]
                out = self._generate_on(base, inputs, agents, max_new_tokens, do_sample)
                for position, row in enumerate(rows):
                    results[row] = (out[0][position], out[1][position], out[2][position])
        prompt_ids, completion_ids, texts = (list(column) for column in zip(*results))
        return prompt_ids, completion_ids, texts

    def _generate_on(
        self, base: BasePart, model_inputs: list, agent_index: list[int], max_new_tokens, do_sample, environments=None
    ):
        if self.tool_calling is not None:
            return self._generate_with_tools(base, model_inputs, agent_index, max_new_tokens, do_sample, environments)
        # rendered as TRL's `_tokenize_prompts` does (conversations through the chat template)
        prompt_ids, _, _ = tokenize_text_prompts(
            base.tokenizer, self.spec.get("chat_template_kwargs", {}), None, model_inputs
        )
        prompt_ids = [list(ids) for ids in prompt_ids]
        completion_ids = self._completions(base, prompt_ids, agent_index, max_new_tokens, do_sample)
        return prompt_ids, completion_ids, base.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    def _generate_with_tools(self, base: BasePart, model_inputs, agent_index, max_new_tokens, do_sample, environments):
        """As the trainer's rows (`TeamGeneration.generate`): each row rendered with its agent's tools (its episode's
        environment's methods bound to it), its calls run and the row going on after their results, round after round,
        every row that goes on in one call (`tool_calling.ToolLoop`); an answer is its last assistant message's."""
        tools = self.tool_calling
        environments = environments or [None] * len(agent_index)
        row_tools = [tools.team.of(agent, environment) for agent, environment in zip(agent_index, environments)]
        prompt_ids = tools.render(model_inputs, row_tools)
        completion_ids = self._completions(base, prompt_ids, agent_index, max_new_tokens, do_sample)
        rows = [
            ToolRow(agent, list(conversation), list(ids), list(completion), tools_of_row)
            for agent, conversation, ids, completion, tools_of_row in zip(
                agent_index, model_inputs, prompt_ids, completion_ids, row_tools
            )
        ]

        def more(sequences, agents):  # a round of the loop: one call over the rows that go on
            return self._completions(base, sequences, agents, max_new_tokens, do_sample), None

        loop = ToolLoop(
            tools.parse, tools.suffix_ids, more, tools.max_iterations, max_new_tokens, tools.max_model_length
        )
        loop.run([row for row in rows if row.tools])
        texts = [
            row.answer if row.tools else base.tokenizer.decode(row.completion_ids, skip_special_tokens=True)
            for row in rows
        ]
        return prompt_ids, [row.completion_ids for row in rows], texts

    def _completions(self, base: BasePart, prompt_ids: list[list[int]], agent_index, max_new_tokens, do_sample):
        """Each row's completion ids (through its end-of-sequence token) after its prompt ids, each row through its
        agent's adapter: one vLLM call, or one routed `generate` call on `base`."""
        tokenizer, model = base.tokenizer, base.model
        width = max(len(ids) for ids in prompt_ids)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        adapters = [self._adapters[a] for a in agent_index]
        eos_ids = self._eos_token_ids(base)
        if self.engine is not None:
            rows = self.engine.generate(
                prompt_ids, adapters, max_new_tokens, do_sample, eos_ids, model.generation_config
            )
        else:
            input_ids, attention_mask = left_padded(prompt_ids, pad_id, None, next(model.parameters()).device)
            if base.router is not None:
                base.router.route(adapters)
            generate = base.decoder.generate if base.decoder is not None else model.generate
            try:
                output = generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=do_sample,
                    pad_token_id=pad_id,
                )
            finally:
                if base.router is not None:
                    base.router.route(None)
            rows = output[:, width:].tolist()
        eos_set = set(eos_ids)
        completion_ids = []
        for row in rows:
            end = next((i + 1 for i, token in enumerate(row) if token in eos_set), len(row))
            completion_ids.append(row[:end])
        return completion_ids

    def stop_token_ids(self, agent: int) -> list[int]:
        """The tokens that end the completions of `agent` (its index): its base's end-of-sequence tokens, from the
        base model's generation config and its tokenizer (what `run` cuts completions after)."""
        return self._eos_token_ids(self.bases[self.agent_base[agent]])

    def _eos_token_ids(self, base: BasePart | None = None) -> list[int]:
        base = base or self.bases[0]
        eos = base.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return list(dict.fromkeys([*eos, base.tokenizer.eos_token_id]))

    def close(self) -> None:
        """Shut down the vLLM engine, if the team has one, and free the captured decode step's caches (kept between
        calls to `run` and `play` otherwise)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        for base in self.bases:
            if base.decoder is not None:
                base.decoder.release()


def read_team_file(path: str | os.PathLike) -> dict:
    team_file = Path(path) / TEAM_FILE
    if not team_file.is_file():
        raise FileNotFoundError(
            f"No {TEAM_FILE} in {path}: point `load_team` at a folder written by MAGRPOTrainer.save_model or "
            "ATGRPOTrainer.save_model (the output_dir or a checkpoint-N folder)."
        )
    spec = json.loads(team_file.read_text())
    if spec.get("format") != TEAM_FORMAT:
        raise ValueError(f"{team_file} has format {spec.get('format')!r}; this trl_marl reads {TEAM_FORMAT!r}.")
    return spec


def load_team(
    path: str | os.PathLike,
    *,
    load_in_4bit: bool | None = None,
    quantization_config: BitsAndBytesConfig | None = None,
    base_model: str | None = None,
    base_models: dict[str, str] | None = None,
    transition: Callable | None = None,
    scheduler: Any = None,
    dtype: str | torch.dtype | None = None,
    device_map: Any = None,
    use_vllm: bool = False,
    vllm_gpu_memory_utilization: float = 0.3,
    vllm_max_model_length: int | None = None,
    captured_decode: bool | str | None = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable | None = None,
) -> Team:
    """Rebuild a team saved by a trainer's `save_model`: each base model once (one for most teams; agents that trained
    on their own `model` get theirs, `team.json` names it), each agent's adapter on its base, built from its own saved
    config. The tools and environment it trained with (`saved_tools`), with which it plays, are rebuilt when it first
    plays (`Team.run`, `Team.play`): serving it (`serve_team`, `trl-marl serve`) never needs them.

    Args:
        path: the saved folder (`output_dir` or a `checkpoint-N` folder), or the Hub repo id of a pushed team
            (fetched with `snapshot_download`; from the Hub cache under `HF_HUB_OFFLINE`).
        load_in_4bit: load every base in 4-bit NF4 (bitsandbytes), or, with False, none; or pass `quantization_config`.
            Left None, a base loads as its agents' team.json entries record (`load_in_4bit`: the agent's own, or
            the trainer's that its base followed), else unquantized.
        base_model: a Hub id or path overriding the recorded base model (the first agent's base).
        base_models: Hub ids or paths of the bases, keyed by the names team.json records (another base is named in
            its agents' `model`): where a base is on this machine when its recorded name does not find it.
        transition: overrides the recorded transition; needed when the training transition was not importable
            (a lambda or a local function).
        scheduler: overrides the recorded scheduler (a plugin name or object); training's is used by default.
        dtype: passed to `from_pretrained` for every base; left None, a base loads in the `dtype` its agents recorded,
            else in the checkpoint's ("auto").
        device_map: passed to `from_pretrained`.
        use_vllm: generate with a vLLM engine (`SavedTeamEngine`) serving the base once and each saved adapter as
            a LoRA, in the loaded model's dtype (NF4 through vLLM's bitsandbytes on a 4-bit base); `Team.close()`
            frees it. `vllm_gpu_memory_utilization` (vLLM's share of the GPU's memory, of the machine's RAM on the
            CPU; 0.3 by default, as in training: vLLM's own 0.92 leaves a shared machine nothing) and
            `vllm_max_model_length` (the model's when None) are passed to it as in training; a tool-calling round
            keeps within it, as in training. With `do_sample=True`, `torch.manual_seed` makes `run` sample the same
            tokens again, as with `generate`.
        captured_decode: without vLLM, generate through the captured decode step
            (`trl_marl.generation.captured_decode`): None chooses by device (CUDA graphs on CUDA), True forces it,
            "cuda-graphs" or "compiled" names the mechanism, False is eager `generate`.
        tools: functions given again, each standing in for the recorded tools of its `__name__` that cannot be
            rebuilt here: a tool team.json could not name by import path (a lambda or a local function), or whose
            name does not import here. A recorded tool that imports here is never replaced: when every tool a
            function is given for imports, playing the team is an error saying so.
        environment_factory: stands in for the recorded environment factory; needed when it could not be recorded
            by import path, or does not import here.

    Raises:
        FileNotFoundError: a base cannot be found (`find_bases`); the message says what to pass.
        ValueError: an adapter's saved weights do not match its saved config (`bases.load_base_adapters`). When the
            team first plays, `run` and `play` raise `saved_tools.UnrebuiltTool` (a ValueError) for a tool or the
            environment factory it trained with that cannot be rebuilt here (the message names it, its agent, and
            what to pass), and ValueError for a function in `tools` that stands in for none.
    """
    path = resolve_team_folder(path)
    spec = read_team_file(path)
    task = None
    if spec.get("task"):
        try:
            task = resolve_task(spec["task"])
        except PluginError:
            task = None  # needed only to rebuild the transition (below) or an environment state
    if transition is None and spec["transition"] is None and spec.get("task"):
        try:
            transition = resolve_task(spec["task"]).transition
        except PluginError as error:
            raise ValueError(
                f"The team in {path} was trained on task {spec['task']!r}, whose transition rebuilds its prompts "
                f"between turns, but that task cannot be loaded here ({error}). Install or register the task, or "
                "pass `transition=` to load_team."
            ) from error
    if transition is None:
        if spec["transition"] is None:
            if spec["num_turns"] > 1:
                raise ValueError(
                    f"The team in {path} was trained with a transition that cannot be imported (a lambda or a local "
                    "function), so its prompts between turns cannot be rebuilt: pass `transition=` to load_team."
                )
            transition = default_transition
        else:
            try:
                transition = import_by_name(spec["transition"])
            except (ImportError, AttributeError) as error:
                raise ValueError(
                    f"The team in {path} names its transition {spec['transition']!r}, which cannot be imported here "
                    f"({error}): pass `transition=` to load_team."
                ) from error
    groups = spec_bases(spec)
    if use_vllm and len(groups) > 1:
        raise ValueError(
            f"The team in {path} sits on {len(groups)} base models ({', '.join(groups)}); `use_vllm=True` serves one. "
            "Load it without vLLM."
        )
    bases = load_saved_bases(
        path,
        spec,
        load_in_4bit=load_in_4bit,
        quantization_config=quantization_config,
        dtype=dtype,
        device_map=device_map,
        base_model=base_model,
        base_models=base_models,
    )
    first, others = bases[0], bases[1:]
    scheduler = resolve_scheduler(scheduler or spec.get("scheduler", "parallel"))
    engine = None
    if use_vllm:
        from ..generation.vllm_serving import SavedTeamEngine

        adapters = list(dict.fromkeys(agent["adapter"] for agent in spec["agents"]))
        engine = SavedTeamEngine(
            first.source,
            {adapter: path / adapter for adapter in adapters},
            lora_rank=max(config.r for config in first.model.peft_config.values()),
            dtype=first.model.dtype,  # what the trainer's engine serves in (`TeamVLLMGeneration`)
            gpu_memory_utilization=vllm_gpu_memory_utilization,
            max_model_len=vllm_max_model_length,
            quantization="bitsandbytes" if first.quantized else None,
        )
    other_bases = [(base.model, base.tokenizer, base.agents) for base in others]
    return Team(
        first.model,
        first.tokenizer,
        spec,
        transition,
        scheduler,
        task,
        engine,
        captured_decode,
        other_bases,
        tools=functools.partial(saved_tools, spec, str(path), task, tools, environment_factory),
        max_model_length=position_limit(first.model.config, vllm_max_model_length if use_vllm else None)[0],
    )
