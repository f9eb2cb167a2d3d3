"""The estimate: every term of the peak for one training config, summed as
`peak = static + max(generation phase, training phase) + overhead` (`MemoryEstimate`, `estimate_memory`). With
`use_vllm`, the trainer has no generation phase and vLLM's pool sits beside it (`vllm_engine.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .dtypes import byte_widths
from .generation import (
    GenerationTerms,
    captured_call,
    captured_decode_bytes,
    captured_kv_cache_bytes,
    largest_generation,
)
from .geometry import GenerateCall, rollout_geometry, vllm_max_num_seqs
from .shape import lora_parameters, model_shape, parameter_count, targeted_linears
from .training import (
    backward_working_set_bytes,
    log_prob_head_bytes,
    saved_activation_bytes,
    training_layer_bytes,
)
from .vllm_engine import EngineTerms, card_problems, engine_terms
from .weights import adapter_bytes, adapter_counts, base_weight_bytes, critic_count, gradient_bytes, optimizer_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..config import MAGRPOConfig

GIB = 2**30
MIB = 2**20
DEFAULT_PROMPT_LENGTH = 512
# A GPU process holds the CUDA context (torch 2.x with lazy module loading, cuBLAS handles and workspaces: typically
# 300-600 MiB as nvidia-smi reports it) and the caching allocator reserves more than is allocated (block rounding,
# fragmentation). Neither exists on the CPU.
CUDA_CONTEXT_BYTES = 512 * MIB
ALLOCATOR_SLACK = 0.10


@dataclass
class MemoryEstimate:
    """A predicted memory breakdown, in bytes. `peak` = the static part + the larger phase + `overhead`.

    Static: `base_weights`, `adapters`, `optimizer_states`, and with the captured decode step `captured_decode` (the
    router's adapter copies and the graph pool, held for the run). Training phase: `gradients`,
    `saved_activations` (checkpoints or all layers, router weights, autocast weight copies), and the larger of
    `log_prob_head` and `backward_working_set`. Generation phase: `kv_cache` (with the captured decode step,
    every row bucket's static cache), `routed_lora_weights` (0 with the captured decode step: static), and the larger
    of `prefill_working_set` and `generation_logits`.

    A team on several bases (`memory/bases.py`) sums them; `bases` then holds each base's own estimate.

    With `use_vllm`, `vllm` holds the colocated engine's terms and the generation phase is 0 (vLLM generates, not the
    trainer): `peak` is the trainer's, and the engine's pool, a share of the card, comes beside it (`process_peak`,
    `card_check`).
    """

    device: str
    base_weights: int
    adapters: int
    optimizer_states: int
    gradients: int
    saved_activations: int
    log_prob_head: int
    backward_working_set: int
    kv_cache: int
    routed_lora_weights: int
    prefill_working_set: int
    generation_logits: int
    overhead: int
    captured_decode: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    vllm: EngineTerms | None = None
    bases: list[tuple[str, MemoryEstimate]] = field(default_factory=list)  # a team on several bases: each one's own

    @property
    def static(self) -> int:
        return self.base_weights + self.adapters + self.optimizer_states + self.captured_decode

    @property
    def training_phase(self) -> int:
        working = max(self.log_prob_head, self.backward_working_set)
        return self.gradients + self.saved_activations + working

    @property
    def generation_phase(self) -> int:
        return self.kv_cache + self.routed_lora_weights + max(self.prefill_working_set, self.generation_logits)

    @property
    def peak(self) -> int:
        return self.static + max(self.training_phase, self.generation_phase) + self.overhead

    @property
    def peak_phase(self) -> str:
        return "training" if self.training_phase >= self.generation_phase else "generation"

    def process_peak(self, gpu_memory_gb: float) -> int:
        """The process's peak on a card of `gpu_memory_gb` GiB: `peak` without vLLM. With vLLM, the trainer's `peak`
        and the engine's pool beside it for the whole run, `peak + pool`; with `vllm_enable_sleep_mode` (level 1: the
        pool is released while the trainer trains, held while it generates) `max(static + training phase, static +
        pool) + overhead`."""
        if self.vllm is None:
            return self.peak
        pool = self.vllm.pool(int(gpu_memory_gb * GIB))
        if self.vllm.sleep_mode:
            return max(self.static + self.training_phase, self.static + pool) + self.overhead
        return self.peak + pool

    def card_check(self, gpu_memory_gb: float) -> tuple[list[str], list[str]]:
        """`(failures, warnings)` on a card of `gpu_memory_gb` GiB, in words: the peak over the card, and with vLLM the
        engine's own checks (`vllm_engine.card_problems`: the pool free at start, one `vllm_max_model_length` sequence
        in its KV cache; a warning when the largest call's rows do not fit it at once). Raises `ValueError` for a
        vLLM estimate on the CPU, whose pool is a share of the machine's RAM, not of a card."""
        card = int(gpu_memory_gb * GIB)
        if self.vllm is None:
            over = f"out of memory: the peak ({self.peak / GIB:.1f} GiB) is over the card's {gpu_memory_gb:g} GiB"
            return ([] if self.peak <= card else [over]), []
        if self.device != "cuda":
            raise ValueError(
                "vLLM's pool on the CPU is `vllm_gpu_memory_utilization` of the machine's RAM and counts what the "
                "process already holds: the planner predicts the engine on a GPU (`device='cuda'`) only."
            )
        at_start = CUDA_CONTEXT_BYTES + self.base_weights + self.adapters  # optimizer states come at the first step
        return card_problems(self.vllm, card, at_start, self.peak, self.process_peak(gpu_memory_gb))

    def fits(self, gpu_memory_gb: float) -> bool:
        """Whether the run fits a card of `gpu_memory_gb` GiB (cards sold as "24 GB" hold 24 GiB): the peak, and with
        vLLM the pool beside it and the engine's checks (`card_check`; its warnings do not fail)."""
        if self.vllm is None:
            return self.peak <= gpu_memory_gb * GIB
        return not self.card_check(gpu_memory_gb)[0]

    def table(self, gpu_memory_gb: tuple[float, ...] | list[float] = ()) -> str:
        """A readable breakdown in MiB; with card sizes, whether the run fits each (with vLLM: the pool, the KV cache
        left in it and, when it does not fit, why)."""
        rows = [
            ("base weights", self.base_weights),
            ("LoRA adapters", self.adapters),
            ("optimizer states", self.optimizer_states),
            *([("captured decode: adapter copies, graph pool", self.captured_decode)] if self.captured_decode else []),
            ("= static", self.static),
            ("training: gradients", self.gradients),
            ("training: saved activations", self.saved_activations),
            ("training: log-prob head (fused lm_head)", self.log_prob_head),
            ("training: backward working set", self.backward_working_set),
            ("= training phase", self.training_phase),
        ]
        if self.vllm is None:
            rows += [
                ("generation: KV cache", self.kv_cache),
                ("generation: router's concatenated LoRA weights", self.routed_lora_weights),
                ("generation: prefill working set", self.prefill_working_set),
                ("generation: last-token logits + sampling", self.generation_logits),
                ("= generation phase", self.generation_phase),
            ]
        overhead = "overhead (none on the CPU)" if self.device == "cpu" else "overhead (CUDA context + allocator)"
        rows += [(overhead, self.overhead)]
        if self.vllm is None:
            rows += [(f"PEAK ({self.peak_phase} phase)", self.peak)]
        else:
            rows += [("PEAK of the trainer (training phase; vLLM generates)", self.peak)] + self.vllm.rows()
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value / MIB:>10,.0f} MiB" for name, value in rows]
        info = ", ".join(f"{key}={value}" for key, value in self.details.items())
        lines.insert(0, f"Predicted peak memory {self.where} ({info})")
        for position, (label, part) in enumerate(self.bases, start=1):
            lines.insert(
                position,
                f"  base {position}: {label}: static {part.static / MIB:,.0f} MiB, training phase "
                f"{part.training_phase / MIB:,.0f} MiB, generation phase {part.generation_phase / MIB:,.0f} MiB",
            )
        if self.vllm is not None:
            lines.append(self.vllm.describe())
        for size in gpu_memory_gb:
            lines += self._card_lines(size)
        return "\n".join(lines)

    @property
    def where(self) -> str:
        """Where the prediction is for, in words: one GPU, or the machine's RAM for a run on the CPU (`use_cpu`)."""
        if self.device == "cpu":
            return "in RAM, for training on the CPU (use_cpu: true), over what the process holds before loading"
        return "on one GPU"

    def _card_lines(self, size: float) -> list[str]:
        """The verdict for a card of `size` GiB (on the CPU: `size` GiB of RAM): one line, and with vLLM the pool, the
        reasons and the warnings."""
        if self.vllm is None:
            verdict = "fits" if self.fits(size) else "does NOT fit"
            memory = f"{size:g} GiB of RAM" if self.device == "cpu" else f"{size:g} GB card"
            return [f"{memory}: {verdict} ({self.peak / GIB:.1f} of {size:g} GiB)"]
        if self.device != "cuda":
            return [f"{size:g} GB card: not predicted on the CPU (vLLM's pool there is a share of the machine's RAM)"]
        failures, warnings = self.card_check(size)
        card, peak = int(size * GIB), self.process_peak(size)
        pool, kv, tokens = self.vllm.pool(card), self.vllm.kv_cache(card), self.vllm.kv_tokens(card)
        beside = "max(trainer, static + pool)" if self.vllm.sleep_mode else "trainer + pool"
        lines = [
            f"{size:g} GB card: {'does NOT fit' if failures else 'fits'} ({peak / GIB:.1f} of {size:g} GiB = "
            f"{beside}; vLLM pool {pool / GIB:.1f} GiB, KV cache {max(kv, 0) / GIB:.2f} GiB = {tokens:,} tokens)"
        ]
        lines += [f"  - {failure}" for failure in failures] + [f"  warning: {warning}" for warning in warnings]
        lines.append(
            f"  smallest vllm_gpu_memory_utilization whose KV cache holds {self.vllm.needed_tokens():,} tokens on "
            f"this card: {self.vllm.minimum_utilization(card):g}"
        )
        return lines

    def __str__(self) -> str:
        return self.table()


def overhead_bytes(device: str, dynamic: int) -> int:
    """GPU only (0 on the CPU): `CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK · dynamic`, with `dynamic` the larger phase."""
    return CUDA_CONTEXT_BYTES + int(ALLOCATOR_SLACK * dynamic) if device == "cuda" else 0


def estimate_memory(
    config: MAGRPOConfig,
    model_config: PretrainedConfig | None = None,
    *,
    model_name_or_path: str | None = None,
    load_in_4bit: bool = False,
    prompt_length: int = DEFAULT_PROMPT_LENGTH,
    device: str = "cuda",
    model_dtype: Any = None,
    agents: list[int] | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of training `config`'s team on one device, before any weight loads.

    Args:
        config: a `MAGRPOConfig` or `ATGRPOConfig` (agents, adapters, batch sizes, lengths, turns, optimizer,
            `gradient_checkpointing`, `bf16`).
        model_config: the base model's `PretrainedConfig`; read with `AutoConfig.from_pretrained(model_name_or_path)`
            (config.json only) when not given; `model_name_or_path` defaults to the embedded default model.
        load_in_4bit: an NF4 base with double quantization (`trl_marl.precision.four_bit_config`).
        prompt_length: P, the longest task prompt in tokens, chat template and role included.
        device: `"cuda"` (a GPU: Triton log-prob kernel, bf16 4-bit compute, CUDA overhead) or `"cpu"` (what
            `recipes/benchmarks/bench_memory.py` measures: torch log-prob fallback, fp32 4-bit compute, no overhead).
        model_dtype: the dtype of the unquantized weights; defaults to `model_init_kwargs["dtype"]`, else float32.
        agents: the indices of the agents on this base, for one base of a team on several (`memory/bases.py`, which
            sums the bases); all agents by default.

    Formulas: the docstrings of the term functions (`trl_marl.memory`'s docstring lists them). Raises `ValueError` for
    an architecture, LoRA target or optimizer the planner does not know.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"`device` must be 'cuda' or 'cpu', got {device!r}.")
    if model_config is None:
        model_config = _read_model_config(model_name_or_path)
    shape = model_shape(model_config)
    targets = targeted_linears(shape, config.lora_target_modules)
    rank, dtypes = config.lora_r, byte_widths(config, model_config, model_dtype, load_in_4bit)

    # Static: weights, adapters and optimizer states; the adapters' gradients live in the training phase.
    adapter_params = lora_parameters(shape, rank, targets)
    adapters, trained = adapter_counts(config, agents)
    # Critics (IAC, MAAC) are trained adapters too, routed apart from the agents' (not in the routed terms), their
    # forwards after the rollout and after the actors' backward, on prompts only: within the phases counted below.
    critics = critic_count(config, agents)
    optimizer_states = optimizer_bytes(adapter_params, trained + critics, config.optim, dtypes.adapter)

    # Training phase: one micro-batch of `rows` sequences of `seq_len` tokens.
    calls, rows, seq_len = rollout_geometry(config, prompt_length, agents)
    layer = training_layer_bytes(shape, targets, rank, dtypes, rows, seq_len, adapters, load_in_4bit)
    # newer transformers 5 releases name it `activation_checkpointing` (TRL 1.16's `gradient_checkpointing` mirrors it)
    checkpointing = bool(getattr(config, "activation_checkpointing", getattr(config, "gradient_checkpointing", False)))

    # Generation phase: the largest `generate` call; with the captured decode step (`captured_decode`: by default on a
    # GPU), on its bucketed shapes, and the decoder's own buffers are static.
    sorted_sampling = config.top_p < 1.0 or (config.top_k or 0) > 0
    completion = config.max_completion_length
    requested = getattr(config, "captured_decode", None)
    captured = not config.use_vllm and (device == "cuda" if requested is None else bool(requested))
    decoded_calls, captured_buffers = calls, 0
    if captured:
        decoded_calls = [captured_call(call, completion) for call in calls]
        largest_rows = max(call.rows for call in decoded_calls)
        captured_buffers = captured_decode_bytes(
            shape, targets, rank, adapters, dtypes.adapter, largest_rows, dtypes.model
        )
    generation = largest_generation(shape, decoded_calls, completion, dtypes, targets, rank, adapters, sorted_sampling)
    if captured:  # every row bucket's cache, kept through the rollout; the adapter copies are static
        kv_cache = captured_kv_cache_bytes(shape, decoded_calls, completion, dtypes.model)
        generation = generation._replace(kv_cache=kv_cache, routed_lora_weights=0)
    base_weights = base_weight_bytes(shape, dtypes.model, load_in_4bit)
    engine = None
    if config.use_vllm:  # vLLM generates: no generation phase in the trainer; its engine loads the base unquantized
        generation = GenerationTerms(0, 0, 0, 0)
        engine = engine_terms(
            shape,
            utilization=config.vllm_gpu_memory_utilization,
            weights=base_weight_bytes(shape, dtypes.model, False),
            model_bytes=dtypes.model,
            load_in_4bit=load_in_4bit,
            max_loras=adapters,
            max_lora_rank=rank,
            max_model_len=config.vllm_max_model_length,
            model_max_len=getattr(model_config, "max_position_embeddings", None) or 0,
            calls=calls,
            completion_length=completion,
            max_num_seqs=vllm_max_num_seqs(config),  # `TeamVLLMGeneration`'s: the largest call's rows at once
            sleep_mode=bool(config.vllm_enable_sleep_mode),
        )

    estimate = MemoryEstimate(
        device=device,
        base_weights=base_weights,
        adapters=adapter_bytes(adapter_params, adapters + critics, trained + critics, dtypes.adapter),
        optimizer_states=optimizer_states,
        gradients=gradient_bytes(adapter_params, trained + critics, dtypes.adapter),
        saved_activations=saved_activation_bytes(shape, layer, rows, seq_len, dtypes.model, checkpointing),
        log_prob_head=log_prob_head_bytes(shape, rows, seq_len, completion, dtypes, device),
        backward_working_set=backward_working_set_bytes(shape, layer, rows * seq_len, checkpointing),
        **generation._asdict(),
        overhead=0,
        captured_decode=captured_buffers,
        details={
            "parameters": parameter_count(shape),
            "4-bit": load_in_4bit,
            "model dtype bytes": dtypes.model,
            "adapters": adapters,
            "critic adapters": critics,
            "LoRA parameters per adapter": adapter_params,
            "training rows per micro-batch": rows,
            "training sequence length": seq_len,
            "gradient checkpointing": checkpointing,
            "captured decode": captured,
            "largest generate call (rows x prompt)": _longest_call(calls, completion),
        },
        vllm=engine,
    )
    estimate.overhead = overhead_bytes(device, max(estimate.training_phase, estimate.generation_phase))
    return estimate


def _read_model_config(model_name_or_path: str | None) -> PretrainedConfig:
    """`AutoConfig.from_pretrained(model_name_or_path)` (config.json only), the embedded default model's if None."""
    from transformers import AutoConfig

    if model_name_or_path is None:
        from ..team.default_model import default_model_path

        model_name_or_path = default_model_path()
    return AutoConfig.from_pretrained(model_name_or_path)


def _longest_call(calls: list[GenerateCall], completion_length: int) -> str:
    """`"rows x prompt"` of the call with the most tokens, `rows·(prompt + C)` (the first of equals)."""
    biggest = max(calls, key=lambda call: call.rows * (call.prompt_length + completion_length))
    return f"{biggest.rows} x {biggest.prompt_length}"
