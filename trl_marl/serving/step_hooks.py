"""The per-row work of one routed `generate` call, as the hooks `generate` calls at every token: each row samples
with its own settings and generator, records its token and log-probabilities, and stops on its own terms.

`generate` itself runs greedy (`do_sample=False`): for a sampled row, `choose` draws the token from the row's own
distribution and leaves only that token's score finite, so the argmax takes it; a greedy row's scores are left as they
are, so its tokens are exactly those of greedy `generate` (and `Team.run`). That keeps rows with different
temperatures, top-p and seeds in one call, and a seeded row's tokens independent of the rows beside it.
"""

from collections.abc import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from .completion_text import follow_text, stop_string_index
from .grammars import apply_masks
from .rows import GeneratedRow


def nucleus_sample(scores: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """A token (a one-element tensor, left on the device) drawn from `softmax(scores / temperature)` restricted to
    the smallest set of most likely tokens whose probability reaches `top_p` (`scores`: one row's, `(vocabulary,)`)."""
    probs = torch.softmax(scores.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)


class CallHooks:
    """Both hooks of one call over `rows` (the call's batch rows, in order; `generate` may add padding rows after
    them, which are left alone and reported finished).

    Args:
        rows: the rows of the call.
        eos_token_ids: the base's end-of-sequence tokens (kept in the completion, as `Team` keeps them).
        decode: the base tokenizer's decoding of completion ids (special tokens skipped), for stop strings: a
            `CompletionDecoder` decodes each row's text token by token (`GeneratedRow.record`).
        should_yield: called after each step with the number of tokens this call has generated; True ends the call
            for every row (unfinished rows continue in a later call).
    """

    def __init__(
        self,
        rows: list[GeneratedRow],
        eos_token_ids: list[int],
        decode: Callable[[list[int]], str],
        should_yield: Callable[[int], bool],
    ):
        self.rows, self.eos_token_ids, self.decode, self.should_yield = rows, set(eos_token_ids), decode, should_yield
        self.steps = 0
        # Once the call yields, every row is finished for `generate`, but a decoding loop may run a few more steps
        # before it checks (the captured decoder checks every few tokens): those steps are not recorded.
        self.yielded = False
        self._chosen: list[tuple[int, float, list[tuple[int, float]]] | None] = [None] * len(rows)
        self._drawing_from: dict[int, torch.Tensor] = {}  # row index -> its generator's state before this step

    def generate_kwargs(self) -> dict:
        """The `logits_processor` and `stopping_criteria` keywords of `generate` that call these hooks."""
        return {
            "logits_processor": LogitsProcessorList([ChooseTokens(self)]),
            "stopping_criteria": StoppingCriteriaList([RecordAndStop(self)]),
        }

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Each live row's next token (the argmax, or sampled), its log-probability and the most likely others, for
        all rows at once and read back to the host in one transfer."""
        if self.yielded:
            return scores
        count = len(self.rows)
        live = [index for index, row in enumerate(self.rows) if not row.done]
        if not live:
            return scores
        log_probs = torch.log_softmax(scores[:count].float(), dim=-1)  # the model's, before any grammar
        # a row with a grammar: the tokens it does not allow next get -inf, for the argmax and the draws below
        apply_masks(scores, [(index, self.rows[index].matcher) for index in live if self.rows[index].matcher])
        tokens = scores[:count].argmax(dim=-1)
        sampled = [index for index in live if self.rows[index].request.temperature > 0]
        # each sampled row's generator as it was before this step's draw: a step that fails before its tokens are
        # recorded is drawn again from there (`rewind`), so a seeded row samples as it would have
        self._drawing_from = {index: self._generator(index, scores.device).get_state() for index in sampled}
        if sampled:
            drawn = torch.cat([self._draw(index, scores[index]) for index in sampled])
            at = torch.tensor(sampled, device=scores.device)
            tokens[at] = drawn
            # only the drawn token stays finite, so `generate`'s argmax takes it
            kept = scores[at, drawn]
            scores[at] = float("-inf")
            scores[at, drawn] = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))
        columns = [tokens.double()[:, None], log_probs.gather(1, tokens[:, None]).double()]
        most = max(self.rows[index].request.top_logprobs for index in live)
        if most:
            values, ids = log_probs.topk(most, dim=-1)
            columns += [ids.double(), values.double()]
        host = torch.cat(columns, dim=1).tolist()  # the call's one wait on the device per step
        for index in live:
            token, log_prob, *top = host[index]
            wanted = self.rows[index].request.top_logprobs
            pairs = [(int(other), value) for other, value in zip(top[:wanted], top[most : most + wanted])]
            self._chosen[index] = (int(token), log_prob, pairs)
        return scores

    def _generator(self, index: int, device: torch.device) -> torch.Generator:
        return self.rows[index].random_generator(device)

    def rewind(self) -> None:
        """Give the rows whose tokens of the step in flight were not recorded their generators as they were before
        its draws (called when the call fails: those rows draw that step again, alone or in a later call)."""
        for index, state in self._drawing_from.items():
            self.rows[index].generator.set_state(state)
        self._drawing_from = {}

    def _draw(self, index: int, scores: torch.Tensor) -> torch.Tensor:
        row = self.rows[index]
        generator = row.random_generator(scores.device)
        return nucleus_sample(scores, row.request.temperature, row.request.top_p, generator)

    def stop(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Record each live row's new token; whether each batch row is done (all, when the call yields)."""
        if self.yielded:
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        finished = [True] * input_ids.shape[0]
        self.steps += 1
        self._drawing_from = {}  # this step's draws are recorded below
        new_tokens = input_ids[: len(self.rows), -1].tolist()
        for index, row in enumerate(self.rows):
            chosen, self._chosen[index] = self._chosen[index], None
            if row.done or chosen is None:
                continue
            _, log_prob, top = chosen
            token = new_tokens[index]  # what `generate` appended: the chosen token
            row.record(token, log_prob, top, self.decode)
            reason = None
            if row.matcher is not None and token not in self.eos_token_ids:
                row.matcher.take(token)
            if row.cancelled:
                reason = "cancelled"
            elif token in self.eos_token_ids:
                reason = "stop"
            elif row.matcher is not None and row.matcher.error is not None:  # never, as the mask allows only its own
                reason = "stop"
            elif row.request.stop and row.decoded.reaches(row.request.stop):
                reason = "stop"
            elif row.remaining_tokens <= 0:
                reason = "length"
            if reason is None:
                finished[index] = False
                row.notify(False)
            else:
                finish(row, reason, self.decode)
        if not all(finished) and self.should_yield(self.steps):
            self.yielded = True
            finished = [True] * len(finished)
        return torch.tensor(finished, dtype=torch.bool, device=input_ids.device)


class ChooseTokens(LogitsProcessor):
    def __init__(self, hooks: CallHooks):
        self.hooks = hooks

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.hooks.choose(scores)


class RecordAndStop(StoppingCriteria):
    def __init__(self, hooks: CallHooks):
        self.hooks = hooks

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.hooks.stop(input_ids)


def finish(row: GeneratedRow, reason: str, decode: Callable[[list[int]], str]) -> None:
    """Mark `row` done: its text decoded whole and cut before its first stop string (and the tokens past the cut
    dropped, so that its tokens, log-probabilities and usage are those of its text), its listener told."""
    text = decode(row.completion_ids)
    cut = stop_string_index(text, row.request.stop) if row.request.stop else None
    if cut is not None:
        decoded = row.decoded if row.decoded is not None else follow_text(decode, row.completion_ids)
        keep = decoded.tokens_through(cut)
        del row.completion_ids[keep:], row.logprobs[keep:], row.top_logprobs[keep:]
    row.text = text if cut is None else text[:cut]
    row.finish_reason = "stop" if cut is not None and reason == "length" else reason
    row.notify(True)
