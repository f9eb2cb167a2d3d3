"""A request's rows: its prompts rendered and tokenised for its agent, checked against the context, with the
sampling, completion budget and output rules of each row (`PromptRenderer.rows_of`).

A chat request's messages get the agent's role (its system prompt, merged as training and `Team.run` merge it) and
are rendered with the chat template of the agent's base. A request that offers tools, or whose history holds a tool
exchange, is rendered with the base's tool template (`trl_marl.generation.tool_templates`: the base's own when it
renders tools, else ChatML with Hermes-style calls for a ChatML base, else a 400 saying why), and its answers are read
back into tool calls (`tool_calls.AnswerReader`). A request whose tool choice or response format constrains the answer
gets its grammar compiled here (`grammars.py`); each of its rows samples under it.

Before any of that, a prompt that cannot fit the context is refused by its size (`fewest_tokens`): rendering runs on
the server's tokenising thread, and a body of megabytes must not hold it for seconds.
"""

import threading
from dataclasses import dataclass

from ..agents import agent_prompt
from ..generation.tool_templates import (
    CHATML_TOOLS,
    ToolsUnsupported,
    prepare_response_parsing,
    tool_chat_template,
    tool_template_name,
)
from ..team.base_generation import tokenize_text_prompts
from .errors import APIError, invalid
from .requests import MIN_SAMPLING_TEMPERATURE, GenerationRequest
from .rows import RowRequest
from .tool_calls import AnswerReader

# A prompt longer than this many characters per token of the context is measured by tokenising that much of it first.
PREFIX_CHARACTERS_PER_TOKEN = 16
CHUNK_CHARACTERS = 16_384  # how much of a long prompt is tokenised at a time while counting its tokens


@dataclass
class RenderedRequest:
    """A request's rows for the engine, its prompt tokens, and how its answers are read (`AnswerReader`)."""

    rows: list[RowRequest]
    prompt_tokens: int
    reader: AnswerReader


class PromptRenderer:
    """Renders the requests of one server (`rows_of`); what it learns of each base (its longest token, its tool
    template, its grammars) is kept.

    Args:
        engine: the server's engine (its team, tokenizers, context lengths and grammars).
        max_request_rows: a request asking for more completions is refused (400).
        max_logprob_entries: a request whose log-probabilities could pass this many values is refused (400).
        default_max_tokens: a request's completion length when it sets none (cut to what fits the context).
        default_temperature, default_top_p: the sampling of a request that sets none.
    """

    def __init__(
        self,
        engine,
        max_request_rows: int,
        max_logprob_entries: int,
        default_max_tokens: int,
        default_temperature: float,
        default_top_p: float,
    ):
        self.engine, self.team = engine, engine.team
        self.max_request_rows, self.max_logprob_entries = max_request_rows, max_logprob_entries
        self.default_max_tokens = default_max_tokens
        self.default_temperature, self.default_top_p = default_temperature, default_top_p
        self.token_bytes = {id(base.tokenizer): longest_token_bytes(base.tokenizer) for base in self.team.bases}
        self._tool_templates: dict[int, str | None] = {}
        self._lock = threading.Lock()

    def rows_of(self, parsed: GenerationRequest, agent: int) -> RenderedRequest:
        """The engine's rows of a request to `agent` (`n` per prompt). Raises `APIError` (400) naming the field for
        what cannot be served."""
        prompt_count = len(parsed.prompts) if parsed.kind == "completion" else 1
        if prompt_count * parsed.n > self.max_request_rows:
            raise APIError(
                400,
                f"The request asks for {prompt_count * parsed.n} completions ({prompt_count} prompt(s), n = "
                f"{parsed.n}), more than this server's limit of {self.max_request_rows} per request: send fewer "
                "prompts, a smaller `n`, or several requests.",
                param="n" if prompt_count == 1 else "prompt",
            )
        engine, rules = self.engine, parsed.rules
        tokenizer, context = engine.tokenizer_of(agent), engine.context_length(agent)
        check_fits_before_tokenising(parsed, tokenizer, self.token_bytes[id(tokenizer)], context)
        prompts, kwargs, tools = parsed.prompts, {}, None
        if parsed.kind == "chat":  # the agent's role as training and `Team.run` put it (merged into a system message)
            use_chat_template = getattr(tokenizer, "chat_template", None) is not None
            system_prompt = self.team.agents[agent].get("system_prompt") or ""
            prompts = [agent_prompt(system_prompt, parsed.prompts, use_chat_template)]
            kwargs = dict(self.team.spec.get("chat_template_kwargs") or {})
            template_name = None
            if (rules is not None and rules.tools) or holds_tool_exchange(parsed.prompts):
                template_name = self.tool_template(tokenizer, "tools" if rules and rules.tools else "messages")
                if template_name is not None:
                    kwargs["chat_template"] = tool_chat_template(tokenizer, template_name)
                tools = list(rules.tools) if rules is not None and rules.tools else None
        try:
            prompt_ids, _, _ = tokenize_text_prompts(tokenizer, kwargs, tools, prompts)
        except Exception as error:  # a chat template that refuses the conversation (roles, order)
            param = "messages" if parsed.kind == "chat" else "prompt"
            raise APIError(400, f"The prompt cannot be rendered for `{parsed.model}`: {error}", param=param) from error
        empty = next((index for index, ids in enumerate(prompt_ids) if not ids), None)
        if empty is not None:  # nothing to condition on: `generate` cannot start from no token
            param = "messages" if parsed.kind == "chat" else ("prompt" if len(prompt_ids) == 1 else f"prompt[{empty}]")
            raise APIError(
                400, f"`{param}` is empty: it renders to no tokens. Send at least one character.", param=param
            )
        max_tokens = completion_budget(parsed, prompt_ids, context, self.default_max_tokens)
        check_logprob_entries(parsed, len(prompt_ids) * parsed.n * max_tokens, self.max_logprob_entries)
        grammar = self.grammar(parsed, agent, tokenizer) if rules is not None and rules.constrained else None
        temperature = self.default_temperature if parsed.temperature is None else parsed.temperature
        if temperature < MIN_SAMPLING_TEMPERATURE:  # as vLLM: below it, sampling is the argmax (and would overflow)
            temperature = 0.0
        top_p = self.default_top_p if parsed.top_p is None else parsed.top_p
        rows = [
            RowRequest(
                agent,
                list(ids),
                max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=None if parsed.seed is None else parsed.seed + choice,
                stop=parsed.stop,
                top_logprobs=parsed.top_logprobs or 0,
                grammar=grammar,
            )
            for ids in prompt_ids
            for choice in range(parsed.n)
        ]
        return RenderedRequest(rows, sum(len(ids) for ids in prompt_ids), AnswerReader(tokenizer, rules))

    def tool_template(self, tokenizer, param: str) -> str | None:
        """The base's tool template (`tool_templates.tool_template_name`), its answers made parseable; a base that
        cannot call tools is a 400 naming `param`."""
        with self._lock:
            if id(tokenizer) not in self._tool_templates:
                try:
                    name = tool_template_name(tokenizer)
                    prepare_response_parsing(tokenizer, name)
                except ToolsUnsupported as error:
                    raise invalid(param, str(error), code="tools_unsupported") from None
                self._tool_templates[id(tokenizer)] = name
            return self._tool_templates[id(tokenizer)]

    def grammar(self, parsed: GenerationRequest, agent: int, tokenizer):
        """The compiled grammar of the request's output rules on the agent's base (`grammars.py`)."""
        rules = parsed.rules
        calls_constrained = rules.tool_choice in ("required", "function")
        param = "tool_choice" if calls_constrained else "response_format"
        if not getattr(self.engine, "serves_grammars", False):
            raise invalid(
                param,
                f"`{param}` constrains what the model writes, which this server's engine (vLLM) does not do here: "
                "serve the team without `use_vllm`, or ask for `tool_choice: auto` and a text `response_format`.",
                code="unsupported_parameter",
            )
        if rules.tools and rules.tool_choice != "none":
            hermes = self.tool_template(tokenizer, "tools") == CHATML_TOOLS or (
                AnswerReader(tokenizer, rules).opening == "<tool_call>"
            )
            if not hermes:
                raise invalid(
                    param,
                    "Constrained tool calls are written in the Hermes format (`<tool_call>{...}</tool_call>`), which "
                    "this base's chat template does not use: ask for `tool_choice: auto`.",
                    code="unsupported_parameter",
                )
        grammars = self.engine.grammars_of(agent)
        return grammars.compiled(rules, "response_format.json_schema.schema" if not calls_constrained else param)


def holds_tool_exchange(messages: list[dict]) -> bool:
    """Whether a conversation holds a tool call or a tool result (which only a tool template renders)."""
    return any(message.get("tool_calls") or message["role"] == "tool" for message in messages)


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: its longest vocabulary entry's (an entry's
    characters take at least as many bytes as the text it decodes to: byte-level BPE's byte characters, SentencePiece's
    `▁` and `<0xNN>`), special and added tokens included."""
    return max(len(piece.encode()) for piece in tokenizer.get_vocab())


def fewest_tokens(text: str, tokenizer, token_bytes: int, context: int) -> int:
    """A lower bound on the tokens of `text`, at a cost that stops growing once it passes `context`: its UTF-8 bytes
    over the most one token stands for (`token_bytes`; halved, for normalisers that shorten text, NFKC's ligatures),
    else, for a text longer than `PREFIX_CHARACTERS_PER_TOKEN` characters per token of `context`, the tokens of its
    pieces of `CHUNK_CHARACTERS` characters counted until they pass `context` (each less two: a cut may split a word,
    which tokenised whole takes fewer). A shorter text gets the first bound alone: tokenising it whole is cheap."""
    bound = len(text.encode()) // (2 * token_bytes)
    if bound >= context or len(text) <= PREFIX_CHARACTERS_PER_TOKEN * context:
        return bound
    counted = 0
    for start in range(0, PREFIX_CHARACTERS_PER_TOKEN * context, CHUNK_CHARACTERS):
        chunk = text[start : start + CHUNK_CHARACTERS]
        counted += max(0, len(tokenizer(chunk, add_special_tokens=False)["input_ids"]) - 2)
        if counted >= context:
            break
    return max(bound, counted)


def check_fits_before_tokenising(parsed: GenerationRequest, tokenizer, token_bytes: int, context: int) -> None:
    """Refuse (400, `context_length_exceeded`) a prompt whose text alone cannot fit the context (`fewest_tokens`),
    before its chat template and tokenisation: a body of megabytes costs a few milliseconds."""
    texts = ["".join(m["content"] for m in parsed.prompts)] if parsed.kind == "chat" else parsed.prompts
    fewest = max(fewest_tokens(text, tokenizer, token_bytes, context) for text in texts)
    if fewest >= context:
        param = "messages" if parsed.kind == "chat" else "prompt"
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, the {param} alone is at least "
            f"{fewest} tokens. Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def check_logprob_entries(parsed: GenerationRequest, completion_tokens: int, limit: int) -> None:
    """Refuse (400, naming `top_logprobs` and `max_tokens`) a request whose log-probabilities could pass `limit`
    values: its completion tokens (rows x `max_tokens`) times 1 + `top_logprobs`."""
    if parsed.top_logprobs is None:
        return
    entries = completion_tokens * (1 + parsed.top_logprobs)
    if entries > limit:
        name = "top_logprobs" if parsed.kind == "chat" else "logprobs"
        raise APIError(
            400,
            f"The request may return {entries} log-probabilities ({completion_tokens} completion tokens: the rows "
            f"times `max_tokens`, each with 1 + `{name}` = {1 + parsed.top_logprobs} values), more than this "
            f"server's limit of {limit}: lower `{name}`, `max_tokens` or `n`.",
            param=name,
            code="logprobs_too_large",
        )


def completion_budget(parsed: GenerationRequest, prompt_ids: list[list[int]], context: int, default: int) -> int:
    """The completion length of a request's rows: its `max_tokens`, which must fit the context with the longest
    prompt, else the default cut to what fits. Raises `APIError` (400, `context_length_exceeded`)."""
    longest = max(len(ids) for ids in prompt_ids)
    param = "messages" if parsed.kind == "chat" else "prompt"
    requested = parsed.max_tokens if parsed.max_tokens is not None else 1
    if longest + requested > context:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested {longest + requested} "
            f"tokens ({longest} in the {param}, {requested} for the completion). Please reduce the length of the "
            f"{param} or the completion.",
            param=param,
            code="context_length_exceeded",
        )
    return parsed.max_tokens if parsed.max_tokens is not None else min(default, context - longest)
