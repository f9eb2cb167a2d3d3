"""The team's decode step captured once and replayed: transformers' `generate` with a static KV cache, the one-token
forward recorded as a CUDA graph (`path="cuda-graphs"`, the default on CUDA) or compiled (`path="compiled"`,
`torch.compile`), and the routing to each row's adapter held in tensors (`routing.AdapterRouter.tensor_routing`).

Eager `generate` with LoRA on every linear is bound by kernel launches and Python: on an H100 a decode step of a 135M
model took 21 ms for the base alone and 55 ms routed to 2 agents, flat from 16 to 64 rows. A captured step launches
one graph. `CapturedDecoder.generate` keeps `generate`'s preparation (generation config, special tokens, logits
processors, stopping criteria: sampling settings keep their meaning) and hands it a decoding loop of its own
(`custom_generate`, transformers' public hook for one): the prompt's prefill runs eagerly, then each token is one call
of the captured step on fixed shapes. Shapes are bucketed so a handful of graphs serve every call: a batch is padded
with rows whose output nothing reads (`ROW_BUCKETS`), and the cache is sized up to a multiple of
`CACHE_LENGTH_STEP`. One cache per row bucket (as long as the longest call it served) is kept and reset between calls,
so a replay reads and writes the same memory each time; its rows never reach the next call (the reset zeroes it, and
the attention never reads past a row's own positions). The trainer `release`s the caches and the graphs recorded on
them when a rollout ends, so training gets that memory back; the next rollout records its shapes again (a fraction of
a second each), in a new memory pool.

Every attention layer of that cache is a full-length `StaticLayer`, sliding-window layers included (Mistral-7B-v0.1,
Phi-3-mini-4k, Qwen2's `use_sliding_window`): each writes at absolute positions, as long as the call's bucket, and the
window is enforced by transformers' sliding-window attention mask (`config.sliding_window`). Transformers' own
`StaticCache` makes a sliding layer a rolling buffer as long as its window, which the loop's mask and positions (sized
from the cache) do not fit, and whose Python-int length a recorded step cannot follow. A model with layers of another
type (chunked or linear attention, convolutions, layers reading another's KV, ...) is not served: eager `generate` by
default, refused naming the layer type with `captured_decode=True` (`decode_support.unserved_layer_types`).

The step (`CapturedDecoder._step_function`) reads only static buffers (`StepBuffers`: each row's token and position,
the cache position written, the key mask) and builds its 4-D attention mask from them (`step_attention_mask`, one per
layer type), so transformers' mask creation, with its branches on values, never runs in it: it has no host sync and no
data-dependent branch (it traces whole with `torch.compile(fullgraph=True)`, tested on the CPU). On CUDA it is recorded
by hand, as serving engines record their decode graphs (`record_step`): a few warm-up runs on a side stream, then one
recording per (rows, cache length) in a memory pool every graph since the last `release` shares, then replays with the
inputs copied into the buffers; recording costs a few steps' time instead of a compile's tens of seconds. A graph is
recorded again when the cache or a routing buffer it reads was replaced. `path="compiled"` compiles the same step (CUDA
graphs through `mode="reduce-overhead"` on CUDA); `path="static"` runs it eagerly, the same loop and buffers (what the
CPU tests check token for token). A 4-bit (bitsandbytes) base is served by all three (its 4-bit matmul is a registered
torch op and can be recorded in a CUDA graph).
"""

import copy
import functools
import inspect
import logging
import os
import time

import torch
from peft import PeftModel
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.cache_utils import StaticLayer

from .captured_step import (
    RecordedStep,
    StepBuffers,
    bucket_length,
    bucket_rows,
    compile_cache_dir,
    graph_pool,
    mark_rows_and_length_dynamic,
    record_step,
    step_attention_mask,
)
from .decode_support import (
    PATHS,
    UNSERVED_OPTIONS,
    attention_implementation,
    attention_layer_types,
    choose_path,
    unserved_attention,
    unserved_layer_types,
)
from .routing import AdapterRouter

logger = logging.getLogger(__name__)
FALLBACK_WARNING = (
    "The captured decode step failed (%s); this run samples with eager `generate`. Set `captured_decode=True` to see "
    "the error raised, or False to skip the attempt."
)
CALLER_HOOKS = ("logits_processor", "stopping_criteria")


class CapturedStepFailed(RuntimeError):
    """The captured step failed (with `fall_back`) in a call that gave `generate` hooks of its own (a logits processor,
    stopping criteria): they have seen the call's first tokens, so generating it again would show them twice. The
    decoder generates eagerly from then on (`CapturedDecoder.failure`); the caller continues from what its hooks
    recorded (the serving engine re-queues the call's rows)."""


class CallerHookFailed(Exception):
    """An exception of the caller's own hooks (`error`), carried out of the decode loop as such."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def call_marked(hooks, input_ids, scores, **kwargs):
    """`hooks(input_ids, scores, **kwargs)`, its exception raised as `CallerHookFailed`."""
    try:
        return hooks(input_ids, scores, **kwargs)
    except Exception as error:
        raise CallerHookFailed(error) from error


class MarkedLogitsProcessor(LogitsProcessor):
    def __init__(self, hooks: LogitsProcessorList):
        self.hooks = hooks

    def __call__(self, input_ids, scores):  # `LogitsProcessorList` passes more only to processors that name them
        return call_marked(self.hooks, input_ids, scores)


class MarkedStoppingCriteria(StoppingCriteria):
    def __init__(self, hooks: StoppingCriteriaList):
        self.hooks = hooks

    def __call__(self, input_ids, scores, **kwargs):
        return call_marked(self.hooks, input_ids, scores, **kwargs)


def marked_hooks(kwargs: dict) -> dict:
    """`generate`'s keywords with the caller's `logits_processor` and `stopping_criteria` lists each wrapped as one
    member of a list of its kind, so that their exceptions leave the decode loop as `CallerHookFailed`."""
    marked = dict(kwargs)
    if kwargs.get("logits_processor"):
        marked["logits_processor"] = LogitsProcessorList([MarkedLogitsProcessor(kwargs["logits_processor"])])
    if kwargs.get("stopping_criteria"):
        marked["stopping_criteria"] = StoppingCriteriaList([MarkedStoppingCriteria(kwargs["stopping_criteria"])])
    return marked


# The decoding loop checks whether every row has finished every this many tokens (each check waits for the device).
STOP_CHECK_INTERVAL = 8

# Compiles allowed for the decode step: one per shape (row bucket × cache length), per mode (train / eval), and per
# set of routed forwards (a new router, a grown mask). torch's default of 8 per function would leave a long run, or a
# process with several trainers, silently uncompiled.
RECOMPILE_LIMIT = 64


class CapturedDecoder:
    """Generates for a model (a `PeftModel` with its `AdapterRouter`, or any causal LM) with a captured decode step.

    Args:
        model: the model `generate` is called on.
        router: the model's router, whose current routing (`AdapterRouter.route`) each call follows; None for a model
            without one (a single PEFT adapter or none: then the forward is the model's own).
        path: "cuda-graphs" (the step recorded as CUDA graphs by hand), "compiled" (`torch.compile`, with
            `mode="reduce-overhead"` on CUDA) or "static" (the same loop and buffers, the step eager).
        fall_back: when the captured step fails, log it and generate with eager `generate` from then on (the
            default path's behaviour: `captured_decode=None`), instead of raising.
    """

    def __init__(
        self, model, router: AdapterRouter | None = None, *, path: str = "cuda-graphs", fall_back: bool = False
    ):
        if path not in PATHS:
            raise ValueError(f"Unknown decode path {path!r}; choose one of {PATHS}.")
        if (
            (reason := unserved_layer_types(model.config))
            or (reason := unserved_attention(model.config))
            or (router is not None and (reason := router.tensor_routing_unsupported()))
        ):
            raise ValueError(f"This team's decode step cannot be captured: {reason}. Set `captured_decode=False`.")
        self.model, self.router, self.path, self.fall_back = model, router, path, fall_back
        self.failure: str | None = None  # why the captured step failed, once it has (with `fall_back`)
        # transformers 5.24 calls the cache keyword `cache`; earlier 5.x releases `past_key_values`
        self._generation_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        forward = self._generation_model.forward
        self.cache_keyword = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
        self._caches: dict[int, StaticCache] = {}  # per row bucket
        self._buffers: dict[tuple[int, int], StepBuffers] = {}  # per (rows, cache length)
        self._recorded: dict[tuple[int, int, str], RecordedStep] = {}  # per (rows, cache length, `_routing_mode`)
        self._pool = None  # the memory pool the graphs recorded since the last `release` share
        self._real_rows = 0
        # Seconds spent recording (or compiling) the step for each (rows, cache length), its first call included.
        self.warmups: dict[tuple[int, int], float] = {}
        # Seconds of every CUDA-graph recording, in order: a shape is recorded again after each `release` (a training
        # run's rollouts) and when what it reads was replaced, and `warmups` keeps only its last.
        self.recordings: list[float] = []
        config = model.config.get_text_config(decoder=True)
        windows = {"full_attention": None, "sliding_attention": getattr(config, "sliding_window", None)}
        layer_types = dict.fromkeys(attention_layer_types(config))
        self._windows = {layer_type: windows[layer_type] for layer_type in layer_types}
        dtype = self._generation_model.dtype
        self._additive_dtype = None if attention_implementation(config) == "sdpa" else dtype
        if path == "static":
            self._step = self._step_function
        elif path == "compiled":
            # Inductor keeps what it compiles on disk (its FX graph and AOTAutograd caches, on by default): there, a
            # later run of the same model and shapes loads the kernels instead of generating and building them
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
            # fullgraph: a graph break (a host sync, a branch on a value) is an error, not a silent slow path
            mode = "reduce-overhead" if self._device.type == "cuda" else None
            self._step = torch.compile(self._step_function, mode=mode, fullgraph=True)
        else:
            self._step = self._replay_step

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generation_config: GenerationConfig | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`model.generate(input_ids=..., attention_mask=..., generation_config=..., **kwargs)` (left-padded prompts,
        `max_new_tokens` set), each row through the adapter the router gives it: `(rows, prompt + new tokens)`.

        A call the captured step does not serve (`unserved`: beams, several sequences per prompt, a dict output, a
        streamer; adapters disabled or merged) goes through eager `generate` with `fall_back`, and raises without it.
        With `fall_back`, a captured step that fails (compiling or capturing on an untried device or model) is logged,
        and this call and every later one go through eager `generate`; an error that eager `generate` raises too is
        the call's own, and is raised. Out of memory is always raised."""
        max_new_tokens = kwargs.get("max_new_tokens") or getattr(generation_config, "max_new_tokens", None)
        if max_new_tokens is None:
            raise ValueError("CapturedDecoder.generate needs `max_new_tokens` (it sizes the static cache).")
        routed = self.router.row_adapters if self.router is not None else None
        if routed is not None and len(routed) != input_ids.shape[0]:
            raise ValueError(
                f"The router routes {len(routed)} rows but the call has {input_ids.shape[0]}: route one adapter per "
                "row (`AdapterRouter.route`)."
            )
        eager = functools.partial(
            self.model.generate,
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            **kwargs,
        )
        if self.failure is not None:
            return eager()
        reason = self.unserved(generation_config, kwargs)
        if reason is not None:
            if not self.fall_back:
                raise ValueError(
                    f"The captured decode step cannot serve this call: {reason}. Set `captured_decode=False`, or "
                    "leave it None (such calls then go through eager `generate`)."
                )
            logger.info("This call goes through eager generate: %s.", reason)
            return eager()
        callers_hooks = self.fall_back and any(kwargs.get(name) for name in CALLER_HOOKS)
        if callers_hooks:  # an exception of the caller's own hooks is the call's, never the captured step's
            kwargs = marked_hooks(kwargs)
        try:
            return self._generate(input_ids, attention_mask, generation_config, max_new_tokens, kwargs)
        except torch.OutOfMemoryError:
            raise
        except CallerHookFailed as failed:
            raise failed.error from None
        except Exception as error:
            if not self.fall_back:
                raise
            if self.router is not None:  # eager `generate` takes the call's routing, whatever the failure left
                self.router.route(routed)
            if callers_hooks:  # they have seen this call's first tokens: a second generation would show them twice
                self.failure = f"{type(error).__name__}: {error}"
                logger.warning(FALLBACK_WARNING, self.failure)
                raise CapturedStepFailed(self.failure) from error
            output = eager()  # raises too when the error was the call's own
            self.failure = f"{type(error).__name__}: {error}"
            logger.warning(FALLBACK_WARNING, self.failure)
            return output

    def unserved(self, generation_config: GenerationConfig | None, kwargs: dict) -> str | None:
        """Why the captured step cannot serve a call with these settings (they fall back to the model's own
        `generation_config`), or None."""
        for name, neutral in UNSERVED_OPTIONS.items():
            value = kwargs.get(name, getattr(generation_config, name, None))
            if value is None:
                value = getattr(self._generation_model.generation_config, name, None)
            if value is not None and value != neutral:
                return f"`{name}={value!r}` is not served by the captured decode loop"
        if self.router is not None:
            return self.router.tensor_routing_unsupported()
        return None

    def _generate(
        self, input_ids, attention_mask, generation_config, max_new_tokens: int, kwargs: dict
    ) -> torch.Tensor:
        if generation_config is not None and generation_config.cache_implementation is not None:
            generation_config = copy.deepcopy(generation_config)  # the decoder brings its own cache
            generation_config.cache_implementation = None
        kwargs = {key: value for key, value in kwargs.items() if key != "cache_implementation"}
        rows, width = input_ids.shape
        padded_rows = bucket_rows(rows)
        extra = padded_rows - rows
        if extra:  # copies of the last row, finished from the start (their tokens and LoRA deltas are never read)
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(extra, -1)])
            attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(extra, -1)])
        cache = self._cache(padded_rows, bucket_length(width + max_new_tokens))
        self._real_rows = rows
        generate = lambda: self.model.generate(  # noqa: E731
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            custom_generate=self._decode,
            **{self.cache_keyword: cache},
            **kwargs,
        )
        # The model's own generation config may name a cache implementation (a checkpoint's `generation_config.json`),
        # which `generate` would take beside the decoder's cache and refuse.
        model_config = self._generation_model.generation_config
        model_cache_implementation, model_config.cache_implementation = model_config.cache_implementation, None
        try:
            if self.router is not None and self.router.row_adapters is not None:
                with self.router.tensor_routing(self.router.row_adapters, rows=padded_rows):
                    output = generate()
            else:
                output = generate()
        finally:
            model_config.cache_implementation = model_cache_implementation
        return output[:rows]

    def _cache(self, rows: int, length: int) -> StaticCache:
        """The cache of a row bucket, kept until `release` so that a captured step reads and writes the same memory
        at every call: one per row bucket, as long as the longest call it has served (a longer call replaces it).

        Every layer, sliding-window ones included, is a `StaticLayer` of the full length, written at absolute
        positions, so that the loop's mask and cache positions (sized from the cache) hold for every layer, and a
        window is the attention mask's (transformers' sliding-window mask, from `config.sliding_window`). Transformers'
        `StaticCache` makes a sliding layer a rolling buffer as long as its window, whose Python-int length and
        branches on it a recorded step cannot follow. The only state here that changes per step is a tensor (each
        layer's written length), updated in place. Only full and sliding-window attention get here
        (`unserved_layer_types`)."""
        cache = self._caches.get(rows)
        if cache is not None and cache.get_max_length() >= length:
            cache.reset()
            return cache
        length = max(length, cache.get_max_length() if cache is not None else 0)
        config = self.model.config.get_text_config(decoder=True)
        cache = self._caches[rows] = StaticCache(config=config, max_cache_len=length)
        cache.layers = [StaticLayer(max_cache_len=length) for _ in cache.layers]  # none capped at its window
        return cache

    def release(self) -> None:
        """Free the caches, and the steps recorded on them (the trainer calls this when a rollout ends); the next call
        allocates them again, and records its steps again (a fraction of a second per shape)."""
        self._caches.clear()
        self._buffers.clear()
        self._recorded.clear()
        # With its last graph gone, the pool is released: PyTorch's allocator refuses to record into it again (an
        # internal assert, `use_count > 0`), so the next recording starts a new one.
        self._pool = None

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _step_buffers(self, rows: int, cache) -> StepBuffers:
        """The static inputs of the step for `rows` rows on `cache` (kept per shape, so a recorded step reads them)."""
        key = (rows, cache.get_max_length())
        buffers = self._buffers.get(key)
        if buffers is None:
            device = self._device
            buffers = self._buffers[key] = StepBuffers(
                input_ids=torch.zeros(rows, 1, dtype=torch.long, device=device),
                position_ids=torch.zeros(rows, 1, dtype=torch.long, device=device),
                cache_position=torch.zeros(1, dtype=torch.long, device=device),
                key_mask=torch.zeros(rows, key[1], dtype=torch.bool, device=device),
            )
        return buffers

    def _step_function(self, model, cache, buffers: StepBuffers) -> torch.Tensor:
        """One token per row through the model, reading `buffers` only: its logits, `(rows, vocabulary)`.
        Capture-safe: no host sync and no branch on a value (the mask is built from tensors, `step_attention_mask`;
        transformers' mask creation is skipped by passing a 4-D mask, or one per layer type for a model of
        several)."""
        write_position = buffers.cache_position[0]
        masks = {
            layer_type: step_attention_mask(buffers.key_mask, write_position, window, self._additive_dtype)
            for layer_type, window in self._windows.items()
        }
        output = model(
            input_ids=buffers.input_ids,
            position_ids=buffers.position_ids,
            cache_position=buffers.cache_position,  # what transformers releases before 5.24 write the cache at
            attention_mask=next(iter(masks.values())) if len(masks) == 1 else masks,
            use_cache=True,
            **{self.cache_keyword: cache},
        )
        return output.logits[:, -1]

    def _timed_step(self, model, cache, buffers: StepBuffers) -> torch.Tensor:
        """`_step`, timing its first call for a shape on the compiled path (compiling is its warm-up)."""
        key = (buffers.input_ids.shape[0], buffers.key_mask.shape[1])
        if self.path != "compiled" or key in self.warmups:
            if self.path == "compiled" and self._device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            return self._step(model, cache, buffers)
        started = time.perf_counter()
        logits = self._step(model, cache, buffers)
        if self._device.type == "cuda":
            torch.cuda.synchronize()
        self.warmups[key] = time.perf_counter() - started
        logger.info(
            "Warmed up the compiled decode step for %d rows and %d cache positions in %.1f s (compiled, or loaded "
            "from %s, at the first shape; recorded as a CUDA graph at each shape on a GPU).",
            *key,
            self.warmups[key],
            compile_cache_dir(),
        )
        return logits

    def _replay_step(self, model, cache, buffers: StepBuffers) -> torch.Tensor:
        """The step as a recorded CUDA graph: recorded at the first call for a shape and routing mode (every row on one
        adapter, or mixed: `AdapterRouter.tensor_routing_mode`), and again when the cache or a routing buffer it reads
        was replaced since (`AdapterRouter.tensor_buffers_version`)."""
        key = (buffers.input_ids.shape[0], buffers.key_mask.shape[1], self._routing_mode())
        version = self.router.tensor_buffers_version if self.router is not None else 0
        recorded = self._recorded.get(key)
        if recorded is None or recorded.cache is not cache or recorded.routing_version != version:
            recorded = self._recorded[key] = self._record(model, cache, buffers, version)
        return recorded.replay()

    def _routing_mode(self) -> str:
        """What the step's LoRA layers read, as a recorded step's key: the router's tensor-routing mode, or, unrouted
        (no router, or a call without a routing), PEFT's active adapters by name (a graph recorded for one adapter
        replays that adapter's matmuls)."""
        mode = self.router.tensor_routing_mode if self.router is not None else "unrouted"
        if mode != "unrouted":
            return mode
        active = self.model.active_adapters if isinstance(self.model, PeftModel) else []
        return "unrouted:" + ",".join(active)

    def _record(self, model, cache, buffers: StepBuffers, version: int) -> RecordedStep:
        started = time.perf_counter()
        # Each run of the step advances the cache's written length (transformers 5.24's static layers keep it in a
        # tensor): the warm-ups put it back
        lengths = [
            (layer, layer.cumulative_length.clone())
            for layer in cache.layers
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
        ]

        def restore():
            for layer, length in lengths:
                layer.cumulative_length.copy_(length)

        if self._pool is None:
            self._pool = graph_pool(self._device)
        replay = record_step(functools.partial(self._step_function, model, cache, buffers), restore, self._pool)
        seconds = time.perf_counter() - started
        rows, length = buffers.key_mask.shape
        self.warmups[(rows, length)] = seconds
        self.recordings.append(seconds)
        logger.info("Recorded the decode step for %d rows and %d cache positions in %.2f s.", rows, length, seconds)
        return RecordedStep(replay, cache, version)

    @torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)
    def _decode(
        self,
        model,
        input_ids: torch.Tensor,
        logits_processor,
        stopping_criteria,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ) -> torch.Tensor:
        """The decoding loop `generate` runs (`custom_generate`), as its own `_sample` does but on fixed shapes: the
        prefill eager, each later token one call of the captured step."""
        if synced_gpus or streamer is not None:
            raise ValueError("The captured decode step does not serve synced GPUs (ZeRO-3, FSDP) or streamers.")
        cache = model_kwargs[self.cache_keyword]
        rows, width = input_ids.shape
        device = input_ids.device
        prompt_mask = model_kwargs.get("attention_mask")  # `generate` drops a mask without padding
        if prompt_mask is None:
            prompt_mask = torch.ones_like(input_ids)
        # The mask covers the whole cache from the start, so every step's has one shape: past the prompt every
        # position is a generated token (the causal mask hides those not yet written).
        attention_mask = prompt_mask.new_ones(rows, cache.get_max_length())
        attention_mask[:, :width] = prompt_mask
        position_ids = model_kwargs.get("position_ids")
        if position_ids is None:  # as `generate` makes them
            position_ids = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        cache_positions = torch.arange(cache.get_max_length(), device=device)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache_position=cache_positions[:width],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_keyword: cache},
        ).logits[:, -1]
        if self.router is not None:  # the prefill showed which LoRA layers read one input: they now share matmuls
            self.router.fuse_shared_inputs()
        buffers = self._step_buffers(rows, cache)
        buffers.key_mask.copy_(attention_mask.bool())
        buffers.position_ids.copy_(position_ids[:, -1:])  # advanced before each step
        buffers.cache_position.fill_(width - 1)
        if self.path == "compiled":
            mark_rows_and_length_dynamic(buffers, cache)  # the prefill allocated the cache's tensors

        pad_token_id = generation_config._pad_token_tensor
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        unfinished = torch.zeros(rows, dtype=torch.long, device=device)
        unfinished[: self._real_rows] = 1
        all_finished_at = []  # per token: whether every row had finished (device tensors, read once at the end)
        max_new_tokens = generation_config.max_length - width
        for token_index in range(max_new_tokens):
            scores = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32))
            if generation_config.do_sample:
                next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(scores, dim=-1)
            if has_eos_stopping_criteria and pad_token_id is not None:
                next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            all_finished_at.append(unfinished.max() == 0)
            if token_index + 1 == max_new_tokens:
                break
            if (token_index + 1) % STOP_CHECK_INTERVAL == 0 and bool(all_finished_at[-1]):
                break
            buffers.input_ids.copy_(next_tokens[:, None])
            buffers.position_ids.add_(1)
            buffers.cache_position.add_(1)
            logits = self._timed_step(model, cache, buffers).clone()  # a graph's output is overwritten by its replay
        # Drop the tokens generated after every row had finished (the stop is checked only every few tokens).
        finished = torch.stack(all_finished_at).tolist()
        generated = finished.index(True) + 1 if True in finished else len(finished)
        return input_ids[:, : width + generated]


def captured_decoder(model, router: AdapterRouter | None, requested: bool | str | None) -> CapturedDecoder | None:
    """The decoder for a `captured_decode` setting on the model's device, or None for eager `generate`. Asked for
    explicitly (True) on a model it cannot serve, it raises; chosen by default, it logs why and returns None, and a
    step that fails later falls back to eager `generate` with a warning (`CapturedDecoder.fall_back`)."""
    path = choose_path(requested, next(model.parameters()).device)
    if path is None:
        return None
    try:
        return CapturedDecoder(model, router, path=path, fall_back=requested is None)
    except ValueError as error:
        if requested:
            raise
        logger.info("Eager generate: %s", error)
        return None


def describe(decoder: CapturedDecoder | None) -> str:
    """The decode path in use, in words (for logs and `gpu_check`)."""
    if decoder is None:
        return "eager generate"
    if decoder.failure is not None:
        return f"eager generate (the captured step failed: {decoder.failure})"
    return {
        "cuda-graphs": "captured decode step (static cache, recorded CUDA graphs)",
        "compiled": "compiled decode step (static cache, torch.compile)",
        "static": "static-cache decode loop (eager step)",
    }[decoder.path]
