"""Tool calling on a base: the chat template that renders tools and tool exchanges, and how an answer is parsed back
into tool calls.

A base whose own chat template renders a whole tool exchange (TRL's `supports_tool_calling`: the tools, an assistant's
`tool_calls`, a `tool` message) keeps it, and its answers are parsed with the response template the tokenizer ships or
the one TRL knows for it (`add_response_schema`). A base whose template cannot, but speaks ChatML (`<|im_start|>` and
`<|im_end|>` are tokens of its vocabulary: SmolLM2, the embedded default, drops tools silently), gets
`CHATML_TOOLS_TEMPLATE`: ChatML with Hermes-style tool calls, the format Qwen2.5 uses with the same special tokens,
parsed with TRL's Qwen response template. Any other base cannot call tools: `tool_chat_template` says why.

The chosen template is used wherever the base renders a conversation that carries tools (the server's requests, the
trainer's tool-using rollouts), and recorded in team.json (`tool_chat_template`), so a team is served as it trained.
"""

CHATML_TOOLS = "chatml-hermes"  # the name team.json records for `CHATML_TOOLS_TEMPLATE`

# ChatML with Hermes-style tool calls. Prefix-preserving (each message renders alone, whatever follows it: TRL's
# multi-turn tool loop needs that), with no default system message: a conversation without tools renders as ChatML
# does. Tool calls as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, each tool result a user turn
# `<tool_response>\n...\n</tool_response>`, as Qwen2.5 writes them.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- (tool_call.arguments if tool_call.arguments is string else (tool_call.arguments | tojson)) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {CHATML_TOOLS: CHATML_TOOLS_TEMPLATE}


class ToolsUnsupported(ValueError):
    """A base's chat template cannot render tools, and no tool template fits it."""


def speaks_chatml(tokenizer) -> bool:
    """Whether the tokenizer's chat template is ChatML: it writes `<|im_start|>`, and `<|im_start|>` and `<|im_end|>`
    are single tokens of its vocabulary."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<|im_start|>" not in template:
        return False
    vocabulary = tokenizer.get_vocab()
    return "<|im_start|>" in vocabulary and "<|im_end|>" in vocabulary


def tool_template_name(tokenizer) -> str | None:
    """The tool template a base needs: None when its own chat template renders a whole tool exchange, `CHATML_TOOLS`
    for a ChatML base whose template cannot. Raises `ToolsUnsupported` for any other base, saying why."""
    from trl.chat_template_utils import supports_tool_calling

    if supports_tool_calling(tokenizer):
        return None
    if speaks_chatml(tokenizer):
        return CHATML_TOOLS
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise ToolsUnsupported(
        f"The chat template of {name} cannot render tools (its rendering of a tool call or a tool result drops it), "
        "and it is not ChatML, for which trl_marl has a tool template. Give the base a chat template that renders "
        "tools (`tokenizer.chat_template`, e.g. from a model of the same family that calls tools)."
    )


def tool_chat_template(tokenizer, name: str | None = "auto") -> str | None:
    """The chat template to render a conversation with tools: the template `name` names (`CHATML_TOOLS`), None for the
    tokenizer's own, or "auto" for `tool_template_name`'s choice."""
    if name == "auto":
        name = tool_template_name(tokenizer)
    if name is None:
        return None
    if name not in TEMPLATES:
        raise ToolsUnsupported(f"Unknown tool template {name!r}; trl_marl has {sorted(TEMPLATES)}.")
    return TEMPLATES[name]


def prepare_response_parsing(tokenizer, name: str | None) -> None:
    """Give the tokenizer what `parse_response` needs to read tool calls back: for `CHATML_TOOLS`, TRL's Qwen response
    template; else the tokenizer's own, or the one TRL knows for its chat template (`add_response_schema`). Raises
    `ToolsUnsupported` when none fits."""
    from trl.chat_template_utils import add_response_schema, qwen3_template

    if name == CHATML_TOOLS:
        tokenizer.response_template = qwen3_template
        return
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return
    try:
        add_response_schema(tokenizer)
    except ValueError as error:
        raise ToolsUnsupported(f"trl_marl cannot read tool calls back from this base's answers: {error}") from None


def parse_tool_calls(tokenizer, completion_ids: list[int], prompt_ids: list[int], tools: list | None) -> dict:
    """The assistant message an answer holds: `{"role", "content", "tool_calls"?}`, tool calls as the chat template
    writes them (`{"type": "function", "function": {"name", "arguments": dict}}`), via TRL's `parse_response` (which
    falls back to the text alone when the calls are malformed). The tokenizer was prepared by
    `prepare_response_parsing`."""
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, list(completion_ids), prefix=list(prompt_ids), tools=tools)
