"""Generation: one `generate` call for rows of any agents, each row through its own agent's adapter.

`routing.py` routes each row of a forward to its agent's LoRA adapter, `tensor_routing.py` holds that routing in
tensors for a captured step; `captured_decode.py` (`CapturedDecoder`) replays the one-token decode step as CUDA graphs
or compiled, over the static cache, buffers and mask of `captured_step.py`, serving what `decode_support.py` says it
serves; `team_generation.py` is the rollouts' `generate` hook, with tools (`tool_calling.py`, `tool_templates.py`);
vLLM's engine for a team is `vllm_generation.py` (the trainer's) and `vllm_serving.py` (what any team engine needs).

May import: the foundation modules, `sandbox`, `rollouts` (the records a `generate` call returns) and `tasks`; nothing
above.
"""
