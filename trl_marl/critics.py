"""Critics on the team's base: each a LoRA adapter on the same base as the actors, and a value head (docs/critics.md).

A critic reads a text through its adapter (IAC: an agent's own prompt of the turn, one critic per agent; MAAC: the
turn's joint history, one critic for the team) and gives a value: a linear head on the final hidden state of the
text's last token. Critic adapters are routed like the agents' (any row of a forward through any adapter), so a critic
costs an adapter's parameters and a head's `hidden_size + 1`, not a second model.
"""

import copy
from collections.abc import Sequence

import torch
from peft import LoraConfig, PeftModel

CRITIC_KINDS = ("iac", "maac")
# The one critic of a MAAC team, and the prefix of an IAC team's critics (`critic_<agent>`).
CRITIC_NAME = "critic"
# As CoMLRL's value head: a small normal initialisation and a zero bias, so every value starts near 0.
VALUE_HEAD_INIT_STD = 0.02


def critic_adapter_names(agent_names: Sequence[str], kind: str) -> list[str]:
    """The critics' adapter names: IAC `critic_<agent>` for each agent, MAAC the one `critic`. Raises ValueError
    when `kind` is neither, or when a name would be an agent's own adapter."""
    if kind not in CRITIC_KINDS:
        raise ValueError(f"Unknown critic kind {kind!r}: use one of {CRITIC_KINDS}.")
    names = [f"{CRITIC_NAME}_{agent}" for agent in agent_names] if kind == "iac" else [CRITIC_NAME]
    taken = sorted(set(names) & set(agent_names))
    if taken:
        raise ValueError(
            f"The agent name(s) {taken} are the adapter names of the team's critics: rename the agent(s) in `agents`."
        )
    return names


class ValueHead(torch.nn.Module):
    """A value from a text's final hidden states: `Linear(hidden_size, 1)` at each row's last attended token, in
    float32 whatever the base's dtype.

    Args:
        hidden_size: the base's hidden size.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.normal_(self.linear.weight, std=VALUE_HEAD_INIT_STD)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`hidden_states` (rows, length, hidden) and `attention_mask` (rows, length), padded on either side: the
        value of each row, (rows,), on the head's device, read at its last position whose mask is 1. Raises
        ValueError for a row with no such position."""
        if not attention_mask.any(dim=1).all():
            raise ValueError("A row of `attention_mask` is all zeros: an empty text has no last token to value.")
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.long() * positions).argmax(dim=1).to(hidden_states.device)
        hidden = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), last]
        with torch.autocast(self.linear.weight.device.type, enabled=False):  # float32 under mixed precision too
            return self.linear(hidden.to(self.linear.weight.device, torch.float32)).squeeze(-1)


def attach_critics(
    model: PeftModel, critic_names: Sequence[str], lora_config: LoraConfig, hidden_size: int
) -> torch.nn.ModuleDict:
    """Give `model` (the team's `PeftModel`) one trainable LoRA adapter per critic, configured as the agents' are, and
    return new value heads (`ValueHead`, by critic name) on the device of the model's output layer, where its final
    hidden states are. An adapter the model already carries under a critic's name (a saved run's) is kept and made
    trainable; its head is new all the same. Adapters that were trainable stay trainable."""
    trainable = [name for name in model.peft_config if _requires_grad(model, name)]
    for name in critic_names:
        if name not in model.peft_config:
            # PEFT's `add_adapter` re-activates the active adapter alone, freezing every other one
            model.add_adapter(name, copy.deepcopy(lora_config))
    model.set_requires_grad(list(dict.fromkeys([*trainable, *critic_names])), requires_grad=True)
    device = model.get_output_embeddings().weight.device
    return torch.nn.ModuleDict({name: ValueHead(hidden_size) for name in critic_names}).to(device)


def _requires_grad(model: PeftModel, adapter: str) -> bool:
    """Whether any of `adapter`'s LoRA weights is trainable."""
    return any(parameter.requires_grad for path, parameter in model.named_parameters() if f".{adapter}." in path)
