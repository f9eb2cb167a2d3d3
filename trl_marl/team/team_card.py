"""The model card (`README.md`) of a saved team, from what `team.json` records and what training logged.

TRL's conventions are kept: YAML metadata (`base_model` as a Hub id, never a local path; `library_name`; tags with
`trl` and the trainer's, and `base_model:adapter:<id>`), the method's paper and citation, TRL's citation, the
framework versions. What a team adds: its agents and their roles, the adapter folder of each, how to load it with
`trl_marl.load_team` and with plain PEFT, the training settings and the last logged metrics.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .bases import spec_bases
from .default_model import DEFAULT_MODEL_ID
from .hub import hub_base_model, team_download_patterns

TRL_CITATION = textwrap.dedent("""\
    @software{vonwerra2020trl,
      title   = {{TRL: Transformers Reinforcement Learning}},
      author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
      license = {Apache-2.0},
      url     = {https://github.com/huggingface/trl},
      year    = {2020}
    }""")  # noqa: E501 (TRL's own entry, as its cards print it)
# A prompt for the loading snippet when the training data offers none short enough to print.
GENERIC_PROMPT = [{"role": "user", "content": "Explain why the sky is blue."}]
MAX_EXAMPLE_CHARS = 400
# Beside the saved folder's name in the `load_team` snippet: the card never holds a path of the machine that saved it.
LOAD_FOLDER_COMMENT = "this folder (its path from where you run this), or its Hub id once pushed"
RUN_OPTIONS = ("num_turns", "max_new_tokens", "do_sample")  # `Team.run`'s own keyword arguments: not row columns
FRAMEWORKS = [
    ("trl_marl", "trl-marl"),
    ("TRL", "trl"),
    ("PEFT", "peft"),
    ("Transformers", "transformers"),
    ("PyTorch", "torch"),
    ("Datasets", "datasets"),
    ("Tokenizers", "tokenizers"),
]


@dataclass
class CardContents:
    """What a team's card says beyond `team.json`: where the snippets load it from, the method, and training."""

    model_name: str
    load_from: str  # the Hub id of the pushed team, else the saved folder's name (never a path of the machine)
    from_hub: bool  # whether `load_from` is a Hub id
    trainer_name: str  # "MAGRPOTrainer"
    paper: dict  # the trainer's `_paper`: title, id, citation
    base_model_id: str | None  # the base model's Hub id; None for a local checkpoint
    settings: dict[str, Any] = field(default_factory=dict)  # setting -> value (None values are left out)
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged training metrics
    metrics_step: int | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    dataset_name: str | None = None
    example: dict | None = None  # a training row: `prompt` and the columns the transition reads (without a task)
    tracking: dict[str, str] = field(default_factory=dict)  # e.g. {"Weights & Biases": url}


def team_model_card(spec: dict, contents: CardContents) -> ModelCard:
    """The team's model card: `spec` is the content of `team.json`."""
    base_ids = [base_id for _, base_id in _bases(spec, contents) if base_id]
    tags = list(dict.fromkeys([*contents.tags, "lora", "multi-agent"]))
    tags += [f"base_model:adapter:{base_id}" for base_id in base_ids]
    metadata = ModelCardData(
        base_model=(base_ids if len(base_ids) > 1 else base_ids[0]) if base_ids else None,
        base_model_relation="adapter" if base_ids else None,
        library_name="peft",
        model_name=contents.model_name,
        datasets=contents.dataset_name,
        tags=tags,
    )
    sections = [
        f"# Model Card for {contents.model_name}",
        _summary(spec, contents),
        _agents_section(spec, contents),
        _loading_section(spec, contents),
        _training_section(spec, contents),
        _results_section(contents),
        "### Framework versions\n\n" + "\n".join(f"- {label}: {_version(dist)}" for label, dist in FRAMEWORKS),
        _citations_section(spec, contents),
    ]
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def _bases(spec: dict, contents: CardContents) -> list[tuple[str, str | None]]:
    """Each base of the team, the first agent's first: its recorded name and its Hub id (None for a local one)."""
    names = list(spec_bases(spec))
    return [(names[0], contents.base_model_id), *((name, hub_base_model(name)) for name in names[1:])]


def _summary(spec: dict, contents: CardContents) -> str:
    agents = spec["agents"]
    names = ", ".join(f"`{agent['name']}`" for agent in agents)
    adapters = list(dict.fromkeys(agent["adapter"] for agent in agents))
    if len(adapters) < len(agents):
        carrying = f"one LoRA adapter (`{adapters[0]}/`) that all {len(agents)} agents share"
    else:
        carrying = "one LoRA adapter per agent"
    task = f" on the task `{spec['task']}`" if spec.get("task") else ""
    groups = spec_bases(spec)
    if len(groups) == 1:
        sits = f"The team is one base model, {_base_model_text(spec, contents)}, carrying {carrying}."
    else:
        on = [
            f"{_base_text(name, base_id)} (" + ", ".join(f"`{agents[i]['name']}`" for i in groups[name]) + ")"
            for name, base_id in _bases(spec, contents)
        ]
        sits = (
            f"The team sits on {len(groups)} base models, {', '.join(on[:-1])} and {on[-1]}, each carrying one LoRA "
            "adapter per agent on it."
        )
    text = (
        f"A team of {len(agents)} LLM agents ({names}) trained with {spec['algorithm']}{task}, using "
        f"trl_marl, a plugin of [TRL](https://github.com/huggingface/trl). {sits} "
        f"{_episode_text(spec, contents, len(adapters))}"
    )
    if contents.base_model_id is None:
        text += (
            " The base model is a local checkpoint with no Hub id: on another machine pass `base_model=` (the same "
            "model's Hub id or path) to `load_team`."
        )
    return text


def _episode_text(spec: dict, contents: CardContents, num_adapters: int) -> str:
    """How the agents play an episode and how training scored them, by algorithm."""
    turns = spec["num_turns"]
    episode = f"{turns} turn{'s' if turns != 1 else ''}, scheduler `{spec['scheduler']}`"
    adapter = "its own adapter" if num_adapters == len(spec["agents"]) else "the shared adapter"
    settings = contents.settings
    if spec["algorithm"] == "AT-GRPO":
        k = settings.get("num_generations") or "K"
        alpha = settings.get("team_reward_weight")
        weight = f"α · team reward (α = {_value(alpha)})" if alpha is not None else "α · team reward"
        chosen = "a sampled one" if settings.get("continuation") == "sample" else "the best one"
        return (
            f"The agents act in turn ({episode}), each with {adapter} and its role. In training, at each step the "
            f"acting agent sampled {k} candidates from the same state; they formed one group, each scored {weight} + "
            f"the agent's local reward, and the episode continued from {chosen}."
        )
    return (
        f"The agents play an episode together ({episode}): each answers with {adapter} and its role, and one team "
        "reward scores their joint answer."
    )


def _base_model_text(spec: dict, contents: CardContents) -> str:
    return _base_text(spec["base_model"], contents.base_model_id)


def _base_text(name: str, base_id: str | None) -> str:
    if base_id is None:
        return f"a local checkpoint (`{local_name(name)}`)"
    link = f"[{base_id}](https://huggingface.co/{base_id})"
    if base_id == DEFAULT_MODEL_ID:
        return f"{link} (trl_marl's embedded default model, which `load_team` finds offline too)"
    return link


def local_name(path: str) -> str:
    """A local base model as a card names it: its folder's name, never its path on the machine that saved the team
    (TRL's cards leave a local base out)."""
    return Path(path).name or path


def _cell(text: Any) -> str:
    """`text` made safe for one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\r", "").replace("\n", "<br>") or " "


def _agents_section(spec: dict, contents: CardContents) -> str:
    agents = spec["agents"]
    frozen = [name for name in contents.settings.get("frozen_agents") or [] if name in {a["name"] for a in agents}]
    shared = len({agent["adapter"] for agent in agents}) < len(agents)
    several = len(spec_bases(spec)) > 1
    ids = dict(_bases(spec, contents))
    rows = [
        f"| `{agent['name']}`{' (frozen)' if agent['name'] in frozen else ''} | "
        f"{_cell(agent.get('system_prompt') or '(no system prompt)')} | `{agent['adapter']}/` |"
        + (f" {_cell(_base_cell(agent.get('model', spec['base_model']), ids))} |" if several else "")
        for agent in agents
    ]
    if shared:
        adapters = (
            f"Each agent's role is its system prompt. All agents share one PEFT LoRA adapter, in the folder "
            f"`{agents[0]['adapter']}/`: their roles alone tell them apart."
        )
    else:
        adapters = "Each agent's role is its system prompt; its adapter is a PEFT LoRA adapter in its own folder."
    lines = [
        "## The agents",
        "",
        adapters,
        "",
        "| agent | role (system prompt) | adapter folder |" + (" base model |" if several else ""),
        "|---|---|---|" + ("---|" if several else ""),
        *rows,
    ]
    if frozen:
        names = ", ".join(f"`{name}`" for name in frozen)
        if shared:
            effect = "their completions carried no loss, while the adapter they share trained on the other agents'"
        else:
            effect = "their adapters are as they were when training started"
        lines += [
            "",
            f"Frozen agents (`frozen_agents`: {names}) acted in every training episode but did not train: {effect}.",
        ]
    lines += [
        "",
        "`team.json` records the agents, their roles and adapters, the base model and the episode's settings "
        "(turns, transition, scheduler, completion length and sampling): what `load_team` rebuilds the team from.",
    ]
    return "\n".join(lines)


def _base_cell(name: str, ids: dict[str, str | None]) -> str:
    """A base in the agents table: its Hub id, else its folder's name."""
    return ids.get(name) or local_name(name)


def _example_call(example: dict | None) -> str:
    """`team.run(...)`'s arguments for `example` (a training row) if it is short enough to print, else a generic
    prompt."""
    if example is not None and _is_literal(example.get("prompt")):
        columns = {key: value for key, value in example.items() if key != "prompt"}
        arguments = [repr(example["prompt"])] + [f"{key}={value!r}" for key, value in columns.items()]
        printable = all(
            key.isidentifier() and key not in RUN_OPTIONS and _is_literal(value) for key, value in columns.items()
        )
        if printable and sum(map(len, arguments)) <= MAX_EXAMPLE_CHARS:
            return ", ".join(arguments)
        if len(arguments[0]) <= MAX_EXAMPLE_CHARS:
            return arguments[0]
    return repr(GENERIC_PROMPT)


def _is_literal(value: Any) -> bool:
    """Whether `repr(value)` is Python source that rebuilds it (strings, numbers, lists and dicts of them)."""
    try:
        return value is not None and ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def _string(text: str) -> str:
    """A Python string literal of `text`, double-quoted unless `text` holds a quote (then as `repr` writes it)."""
    literal = repr(str(text))
    return f'"{literal[1:-1]}"' if "'" not in text and '"' not in text else literal


def _episode_lines(spec: dict, contents: CardContents) -> list[str]:
    """The Quick start's episode: on a problem of the task the team trained on (its rows carry the columns that the
    task's environment and transition read), else on the first training row when it prints short, else a prompt."""
    if spec.get("task"):
        return [
            f'row = resolve_task({_string(spec["task"])}).dataset("eval")[0]  # a problem: its prompt and columns',
            "run = team.play([row])[0]",
        ]
    return [f"run = team.run({_example_call(contents.example)})"]


def _loading_section(spec: dict, contents: CardContents) -> str:
    source = _string(contents.load_from)
    adapters = list(dict.fromkeys(agent["adapter"] for agent in spec["agents"]))
    imports = ["from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if contents.from_hub:
        allow, ignore = team_download_patterns(adapters)
        imports.insert(0, "from huggingface_hub import snapshot_download")
        folder_lines = [
            "folder = snapshot_download(  # the adapters and the tokenizer, not the checkpoints pushed beside them",
            f"    {source},",
            f"    allow_patterns={allow!r},",
            f"    ignore_patterns={ignore!r},",
            ")",
        ]
    else:
        folder_lines = [f"folder = {source}  # this folder: its path from where you run this"]
    peft_lines = [*imports, "", *folder_lines]
    groups = spec_bases(spec)
    for index, (name, base_id) in enumerate(_bases(spec, contents)):
        # One block per base: its model, its agents' adapters and its tokenizer (another base's is in its adapters'
        # folders).
        own = list(dict.fromkeys(spec["agents"][agent]["adapter"] for agent in groups[name]))
        n = "" if index == 0 else f"_{index + 1}"
        comment = "" if base_id else "  # a local checkpoint: its path on your machine"
        peft_lines += [
            *([""] if index else []),
            f"base{n} = AutoModelForCausalLM.from_pretrained({_string(base_id or local_name(name))}){comment}",
            f'model{n} = PeftModel.from_pretrained(base{n}, f"{{folder}}/{own[0]}", adapter_name="{own[0]}")',
            *(f'model{n}.load_adapter(f"{{folder}}/{adapter}", adapter_name="{adapter}")' for adapter in own[1:]),
            f"tokenizer{n} = AutoTokenizer.from_pretrained("
            + ("folder)" if index == 0 else f'f"{{folder}}/{own[0]}")'),
            f'model{n}.set_adapter("{own[0]}")  # the adapter that answers next',
        ]
    loads = (
        "loads the base model once and every adapter onto it"
        if len(groups) == 1
        else f"loads each of its {len(groups)} base models once with its agents' adapters"
    )
    if spec.get("task"):
        how = (
            f"`Team.play(rows)` plays one episode per dataset row (here a problem of the task `{spec['task']}`, with "
            "the columns its environment reads), greedy by default, with the prompt building of training:"
        )
    else:
        how = (
            "`Team.run` plays one episode (greedy by default) with the prompt building of training, "
            "`Team.play(rows)` one episode per dataset row:"
        )
    return "\n".join(
        [
            "## Quick start",
            "",
            f"With trl_marl installed, `load_team` takes this team's folder or Hub id, {loads}; {how}",
            "",
            "```python",
            "from trl_marl import load_team",
            *(["from trl_marl.tasks import resolve_task"] if spec.get("task") else []),
            "",
            f"team = load_team({source})" + ("" if contents.from_hub else f"  # {LOAD_FOLDER_COMMENT}"),
            *_episode_lines(spec, contents),
            "for agent, answer in run.final.items():",
            '    print(f"{agent}: {answer}")',
            "```",
            "",
            "Each adapter is also a plain PEFT adapter on its base model. Without trl_marl, give each agent its role "
            "(the system prompt above) and route its prompts through its adapter:",
            "",
            "```python",
            *peft_lines,
            "```",
        ]
    )


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(str(item) for item in (sorted(value) if isinstance(value, set) else value))
    return str(value)


def _training_section(spec: dict, contents: CardContents) -> str:
    paper = contents.paper
    method = spec["algorithm"]
    if paper.get("id"):
        method += f", the method of [{paper['title']}](https://huggingface.co/papers/{paper['id']})"
    settings = {key: value for key, value in contents.settings.items() if value is not None and value != []}
    lines = [
        "## Training procedure",
        "",
        *(f"[{label}]({url})" for label, url in contents.tracking.items()),
        f"This team was trained with {method}, by trl_marl's `{contents.trainer_name}` (a subclass of TRL's "
        "`GRPOTrainer`).",
    ]
    if settings:
        lines += ["", "| setting | value |", "|---|---|"]
        lines += [f"| `{key}` | {_cell(_value(value))} |" for key, value in settings.items()]
    return "\n".join(lines)


def _metrics_table(metrics: dict[str, float]) -> list[str]:
    return ["| metric | value |", "|---|---|", *(f"| `{key}` | {_value(float(v))} |" for key, v in metrics.items())]


def _results_section(contents: CardContents) -> str:
    lines = ["## Results", ""]
    if not contents.metrics:
        lines.append("No training step has been logged yet.")
    else:
        team_reward = contents.metrics.get("reward")
        if team_reward is not None:
            step = f" ({contents.metrics_step})" if contents.metrics_step is not None else ""
            lines += [f"Team reward at the last logged step{step}: {_value(float(team_reward))}.", ""]
        lines.append("The last logged training metrics (`reward` is the team reward, `agents/<name>/...` per agent):")
        lines += ["", *_metrics_table(contents.metrics)]
    if contents.eval_metrics:
        lines += ["", "The last evaluation:", "", *_metrics_table(contents.eval_metrics)]
    return "\n".join(lines)


def _citations_section(spec: dict, contents: CardContents) -> str:
    lines = ["## Citations", ""]
    bases = _bases(spec, contents)
    if len(bases) > 1:
        lines += ["The agents' base models:", ""]
        lines += [f"- {_base_text(name, base_id)}" for name, base_id in bases]
        lines += [""]
    if contents.paper.get("citation"):
        lines += [f"Cite {spec['algorithm']} as:", "", "```bibtex", contents.paper["citation"], "```", ""]
    lines += ["Cite TRL as:", "", "```bibtex", TRL_CITATION, "```"]
    return "\n".join(lines)


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"
