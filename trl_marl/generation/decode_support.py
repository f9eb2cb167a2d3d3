"""What the captured decode step (`captured_decode.CapturedDecoder`) serves, and how the `captured_decode` setting is
read: the decode paths, the attention implementations and layer types its cache and mask serve, the `generate`
options its loop does not, and the path a setting picks on a device.

A model or call outside these goes through eager `generate` by default (`captured_decode=None`) and is refused by name
with `captured_decode=True`.
"""

import torch

try:  # how transformers' own caches read a config's layers (shared-KV and attention-free layers are "dummy")
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # earlier transformers 5 releases: `layer_types`, else inferred (`attention_layer_types`)
    get_layer_types_and_kwargs = None


PATHS = ("cuda-graphs", "compiled", "static")
# The attention implementations whose mask the decode step builds (`captured_decode.step_attention_mask`): sdpa takes
# a bool mask, eager an additive one.
SERVED_ATTENTION = ("sdpa", "eager")
# `generate` options the decoding loop does not serve, with the value under which they change nothing.
# (Stop strings: `generate` does not hand a `custom_generate` loop the tokenizer their criteria need.)
UNSERVED_OPTIONS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "return_dict_in_generate": False,
    "streamer": None,
    "stop_strings": None,
}
# The attention layers the decoder's cache serves. Each gets a full-length `StaticLayer`, written at absolute
# positions; a sliding window is then enforced by the mask (transformers' sliding-window mask reads
# `config.sliding_window`), not by a rolling buffer (transformers' `StaticSlidingWindowLayer` keeps a Python-int length
# and branches on it).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")


def default_path(device: torch.device) -> str | None:
    """The path used when none is asked for: CUDA graphs on a CUDA device; elsewhere None (eager `generate`): the CPU
    step is compute-bound, not launch-bound, and compiled it was 1.2–2.9x slower on 2 cores, after 30–60 s of
    compiling per shape (docs/benchmarks.md, "Decode step")."""
    return "cuda-graphs" if device.type == "cuda" else None


def attention_layer_types(config) -> list[str]:
    """Each decoder layer's type, as transformers reads it to build a cache (`get_layer_types_and_kwargs`; in releases
    without it, the text config's `layer_types`, else "sliding_attention" for every layer of a config with a
    `sliding_window`, "chunked_attention" for one with an `attention_chunk_size`, "full_attention" otherwise)."""
    config = config.get_text_config(decoder=True)
    if get_layer_types_and_kwargs is not None:
        return list(get_layer_types_and_kwargs(config)[0])
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    if getattr(config, "sliding_window", None) is not None:
        layer_type = "sliding_attention"
    elif getattr(config, "attention_chunk_size", None) is not None:
        layer_type = "chunked_attention"
    else:
        layer_type = "full_attention"
    return [layer_type] * config.num_hidden_layers


def unserved_layer_types(config) -> str | None:
    """Why the decoder's cache cannot serve a model of this config (layers other than full or sliding-window
    attention: chunked, linear or convolutional, ...), or None."""
    unserved = sorted(set(attention_layer_types(config)) - set(SERVED_LAYER_TYPES))
    if unserved:
        return (
            f"its {', '.join(f'`{layer_type}`' for layer_type in unserved)} layers have no static cache here (served: "
            f"{', '.join(SERVED_LAYER_TYPES)})"
        )
    return None


def unserved_attention(config) -> str | None:
    """Why the decode loop's mask cannot serve this attention implementation, or None. The loop's mask covers the whole
    static cache and marks positions not yet written as attended (the causal mask hides them); flash attention
    takes a mask of ones as no mask at all and would attend to the cache's empty positions."""
    implementation = attention_implementation(config)
    if "flash" in implementation:
        return f"attention `{implementation}` would read the static cache's empty positions (served: sdpa, eager)"
    if implementation not in SERVED_ATTENTION:
        return f"attention `{implementation}` takes no plain mask (served: {', '.join(SERVED_ATTENTION)})"
    return None


def attention_implementation(config) -> str:
    return getattr(config.get_text_config(decoder=True), "_attn_implementation", None) or "eager"


# What `captured_decode` takes: None (by device), True, False, or the mechanism by name.
CAPTURED_DECODE_SETTINGS = (None, True, False, "cuda-graphs", "compiled")


def captured_decode_setting(value) -> bool | str | None:
    """A `captured_decode` value as given in Python or on a command line (any case; "true", "on", "yes", "1";
    "false", "off", "no", "0"; "none", "auto"), checked: one of `CAPTURED_DECODE_SETTINGS`."""
    words = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}
    words |= {"none": None, "auto": None}
    if isinstance(value, str):
        value = words.get(value.lower(), value.lower())
    if not any(
        value is setting or (isinstance(value, str) and value == setting) for setting in CAPTURED_DECODE_SETTINGS
    ):
        raise ValueError(
            f"`captured_decode` must be None (by device: CUDA graphs on CUDA, eager elsewhere), True, False, "
            f"'cuda-graphs' or 'compiled', got {value!r}."
        )
    return value


def choose_path(requested: bool | str | None, device: torch.device) -> str | None:
    """The decode path for a `captured_decode` setting (None: `default_path`; True: captured, with CUDA graphs where
    the device has them, compiled elsewhere; "cuda-graphs" or "compiled": that mechanism; False: eager `generate`)."""
    requested = captured_decode_setting(requested)
    if requested is None:
        return default_path(device)
    if requested is False:
        return None
    if requested == "cuda-graphs" and device.type != "cuda":
        raise ValueError(
            f"`captured_decode='cuda-graphs'` records CUDA graphs, and the model is on {device.type}: use "
            "'compiled' (or True) off CUDA."
        )
    if requested is True:
        return "cuda-graphs" if device.type == "cuda" else "compiled"
    return requested
