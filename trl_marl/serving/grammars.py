"""Constrained decoding for tool choice and structured output, per row, with llguidance.

A request whose `tool_choice` is "required" or names a function, or whose `response_format` is JSON
(`tool_requests.OutputRules.constrained`), gets a grammar: what the answer may be, as a Lark grammar whose JSON parts
are JSON schemas (`%json {...}`). Each of its rows gets a matcher of that grammar (`RowGrammar`), which at every step
gives the tokens that may come next (a bitmask over the vocabulary, the end-of-sequence tokens allowed only where the
grammar may end) and takes the token sampled. Rows of several requests with different grammars, and rows with none,
share one routed `generate` call: the masks are per row (`step_hooks.CallHooks`).

Why llguidance: it compiles a JSON schema or a Lark grammar for any tokenizer in milliseconds, computes a step's mask
in tens of microseconds on the CPU, and installs as one wheel with no dependencies; vLLM and SGLang use it as one of
their structured-output backends (xgrammar, the other, needs triton and CUDA kernels that a CPU machine does not run).

The grammar of tool calls is the Hermes format of `trl_marl.generation.tool_templates.CHATML_TOOLS_TEMPLATE` (and of
Qwen's own templates): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or (with
`parallel_tool_calls`) several, each call's `name` one of the offered tools and its `arguments` valid against that
tool's `parameters`. JSON is written as the chat templates write it (`json.dumps`' separators, no free whitespace),
so a model cannot spend its tokens on spaces.

The schemas are enforced as `json_schemas.py` prepares them: a tool's open objects closed (and a strict response
format's), and a tool's `$ref`s re-rooted under the one schema of all the calls. A schema llguidance cannot enforce is
a 400 naming the field and its keyword (`BaseGrammars.unservable`), never a position in the grammar built here.
"""

import json
import re
from collections import OrderedDict

import numpy as np
import torch

from .errors import APIError, invalid
from .json_schemas import closed_objects, holds_references, rerooted, unservable_keyword
from .tool_requests import OutputRules

# JSON as `json.dumps` writes it: ", " between items, ": " after keys, no other whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
CACHED_GRAMMARS = 64
GRAMMAR_POSITION = re.compile(r"^at \d+\(\d+\): ")  # where llguidance's error is in the Lark text: not the caller's
GRAMMAR_EXCERPT = re.compile(r"^\s*\d+ \| ")


def require_llguidance():
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise invalid(
            "tool_choice",
            "Constrained decoding (tool_choice required or named, response_format json) needs llguidance, which is "
            'not installed: pip install "trl-marl[serve]".',
        ) from None


def styled(schema: dict) -> dict:
    """`schema` with llguidance's JSON style (`JSON_STYLE`) set on it."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def tool_call_schema(name: str, arguments: dict) -> dict:
    """The JSON of one call of the tool `name` in the Hermes format: `{"name": <its name>, "arguments": ...}`."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_parameters(tool: dict) -> dict:
    """The schema a call's arguments follow: the tool's `parameters` (no arguments when it has none), its open
    objects closed (`json_schemas.closed_objects`)."""
    return closed_objects(tool["function"].get("parameters") or {"type": "object", "properties": {}})


def calls_schema(tools: list[dict]) -> dict:
    """The JSON of one call of any of `tools`. A tool whose parameters hold `$ref`s is kept whole under
    `$defs/<its name>`, its references re-rooted there (`json_schemas.rerooted`)."""
    definitions, calls = {}, []
    for tool in tools:
        name, parameters = tool["function"]["name"], tool_parameters(tool)
        if holds_references(parameters):
            definitions[name] = rerooted(parameters, f"#/$defs/{name}")
            parameters = {"$ref": f"#/$defs/{name}"}
        calls.append(tool_call_schema(name, parameters))
    return {"anyOf": calls, **({"$defs": definitions} if definitions else {})}


def answer_schema(response_format: dict) -> dict:
    """The schema of a JSON answer: `{"type": "object"}` for `json_object`; a `json_schema`'s schema, its open objects
    closed when it is `strict` (as OpenAI's strict mode takes every object as closed), else as given."""
    schema = response_format.get("schema", {"type": "object"})
    return closed_objects(schema) if response_format.get("strict") else schema


def lark_grammar(rules: OutputRules) -> str:
    """The Lark grammar of what an answer under `rules` may be: tool calls (required, named), a JSON answer
    (`response_format`), or either (tools on "auto" with a JSON `response_format`)."""
    lines = []
    if rules.tool_choice in ("required", "function", "auto") and rules.tools:
        opening, closing = json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)
        lines.append(f"call: {opening} call_json {closing}")
        lines.append(f"call_json: %json {json.dumps(styled(calls_schema(rules.offered_tools())))}")
        several = rules.parallel_tool_calls and rules.tool_choice != "function"  # a named function: one call
        lines.append('calls: call ("\\n" call)*' if several else "calls: call")
    answer = None
    if rules.response_format is not None:
        lines.append(f"answer: %json {json.dumps(styled(answer_schema(rules.response_format)))}")
        answer = "answer"
    if rules.tool_choice in ("required", "function"):
        start = "calls"
    elif rules.tools and rules.tool_choice == "auto" and answer:
        start = "calls | answer"
    else:
        start = answer
    return "\n".join([f"start: {start}", *lines]) + "\n"


def grammar_schemas(rules: OutputRules) -> list[tuple[str, str, dict]]:
    """The schemas a grammar of `rules` enforces, each `(the request's field, what it is, the schema as enforced)`."""
    schemas = []
    if rules.tool_choice in ("required", "function", "auto") and rules.tools:
        for tool in rules.offered_tools():
            where = f"tools[{rules.tools.index(tool)}].function.parameters"
            schemas.append((where, f"the tool `{tool['function']['name']}`", tool_parameters(tool)))
    if rules.response_format is not None:
        schemas.append(
            ("response_format.json_schema.schema", "the response format", answer_schema(rules.response_format))
        )
    return schemas


class BaseGrammars:
    """The llguidance tokenizer of one base (built once: about 0.6 s for a 49k vocabulary) and its compiled grammars.

    Args:
        tokenizer: the base's tokenizer (a fast one).
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that end an answer; allowed where the grammar may end.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()  # by Lark text, the last used last

    def compiled(self, rules: OutputRules, param: str) -> "CompiledGrammar":
        """The grammar of `rules`, checked; a schema llguidance refuses is a 400 naming `param`. The last
        `CACHED_GRAMMARS` grammars are kept: the lexer states llguidance builds as a grammar is first used (its first
        answers cost tens of milliseconds a step on 2 CPU cores, later ones a few) serve the next request of the same
        schema."""
        import llguidance

        lark = lark_grammar(rules)
        if lark in self._compiled:
            self._compiled.move_to_end(lark)
            return self._compiled[lark]
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        reason = self.refusal(grammar)
        if reason is not None:
            raise self.unservable(rules, param, reason)
        compiled = self._compiled[lark] = CompiledGrammar(self, grammar)
        while len(self._compiled) > CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def refusal(self, grammar: str) -> str | None:
        """Why llguidance cannot enforce `grammar` (its first line, without the grammar position), or None."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if not failed:
            return None
        lines = []  # its message, up to the Lark excerpt it quotes (the server's grammar, not the caller's schema)
        for line in (messages[0] if messages else "").splitlines():
            if GRAMMAR_EXCERPT.match(line):
                break
            if line.strip(" ^"):  # not a line of carets under a quoted regex
                lines.append(line.strip())
        reason = GRAMMAR_POSITION.sub("", " ".join(lines)).removeprefix("failed to compile JSON schema: ")
        return reason.rstrip(".") or "llguidance refused it"

    def unservable(self, rules: OutputRules, param: str, reason: str) -> APIError:
        """The 400 of a grammar llguidance refused: naming the schema it cannot enforce (a tool's `parameters`, the
        response format's schema) and its keyword (`json_schemas.unservable_keyword`), else `param`."""
        import llguidance

        def refusal_of(schema: dict) -> str | None:
            return self.refusal(llguidance.LLMatcher.grammar_from_lark(f"start: %json {json.dumps(styled(schema))}\n"))

        for where, what, schema in grammar_schemas(rules):
            schema_reason = refusal_of(schema)
            if schema_reason is None:
                continue
            keyword = unservable_keyword(schema, lambda candidate: refusal_of(candidate) is None)
            where = f"{where}.{keyword}" if keyword else where
            return invalid(where, f"`{where}` ({what}) cannot be enforced: {schema_reason}. Change or remove it.")
        return invalid(param, f"`{param}` cannot be enforced: {reason}")


class CompiledGrammar:
    """A request's grammar on one base: each of its rows gets a matcher of its own (`matcher`)."""

    def __init__(self, grammars: BaseGrammars, grammar: str):
        self.grammars, self.grammar = grammars, grammar

    def matcher(self) -> "RowGrammar":
        return RowGrammar(self.grammars, self.grammar)


class RowGrammar:
    """One row's matcher of a grammar: the tokens allowed next (`allowed_mask`) and the token taken (`take`)."""

    def __init__(self, grammars: BaseGrammars, grammar: str):
        import llguidance

        self.grammars = grammars
        self.matcher = llguidance.LLMatcher(grammars.tokenizer, grammar)
        self.error: str | None = None

    def fill_mask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed tokens into row `index` of `bitmask` (llguidance's int32 bitmask, on the CPU)."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, index)

    def take(self, token_id: int) -> None:
        """Advance past the sampled token (which the mask allowed)."""
        if not self.matcher.consume_token(token_id):
            self.error = self.matcher.get_error() or f"token {token_id} refused"

    @property
    def finished(self) -> bool:
        """Whether the grammar allows nothing more (only the end of the answer)."""
        return self.matcher.is_stopped()


def apply_masks(scores: torch.Tensor, grammars: list[tuple[int, RowGrammar]]) -> None:
    """Mask, in place, the scores of the rows that have a grammar (`(row index, matcher)`): a token the grammar does
    not allow next gets -inf."""
    if not grammars:
        return
    from llguidance.torch import allocate_token_bitmask

    vocab = scores.shape[-1]
    bitmask = allocate_token_bitmask(len(grammars), vocab)
    for position, (_, grammar) in enumerate(grammars):
        grammar.fill_mask(bitmask, position)
    rows = torch.tensor([index for index, _ in grammars], device=scores.device)
    allowed = allowed_tokens(bitmask, vocab, scores.device)
    scores[rows] = scores[rows].masked_fill(~allowed, float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """llguidance's bitmask (`(rows, words)` int32, on the CPU; token `32 k + j` is bit `j` of word `k`) as a
    `(rows, vocab)` bool tensor on `device`. In eager torch (numpy on the CPU): llguidance's own
    `apply_token_bitmask_inplace` is a `torch.compile`d kernel, which costs seconds (and a C++ compiler) at its first
    call on the CPU."""
    if device.type == "cpu":
        return unpacked_on_host(bitmask, vocab)
    return unpacked_on_device(bitmask.to(device, non_blocking=True), vocab)


def unpacked_on_host(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask's bits with numpy: the bytes of little-endian words, each byte's bits from the lowest, are the
    tokens in order."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.view(np.bool_))


def unpacked_on_device(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask's bits with torch, on the words' device."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
