"""Step sizes in compiled mode, padded up to buckets (NOTE [vLLM buckets]).

NOTE [vLLM buckets]: with the model under ``torch.compile(backend="tpu")`` each step's sizes (its
tokens, requests, longest query, KV blocks read) are sizes of the compiled graph, and deferfuse
compiles one XLA program for each combination of them. Unpadded, every new combination was a
program, and past Dynamo's recompile limit the model ran in defer mode. So in compiled mode:

- a step's tokens are padded up to a token bucket, as vLLM pads a step for a CUDA graph:
  ``compilation_config.compile_sizes`` when given (vLLM's sizes to compile for), else powers of
  two up to ``max_num_batched_tokens`` and that number itself; the padding tokens write their
  keys and values into vLLM's null block (slot -1) and their outputs are never read;
- the attention's requests, longest query and KV blocks are padded up to powers of two (padding
  requests have no tokens and read the null block), so a program serves every step whose sizes
  round to the same buckets;
- every size is at least 2: Dynamo specializes a dimension of size 0 or 1, which would be a
  graph (and a recompile) of its own;
- the model is compiled with ``dynamic=True`` and without duck sizing, so Dynamo makes one graph
  for decode-only steps and one for steps with a prefill, whatever the sizes: each is compiled
  once by Dynamo, and once by XLA for each combination of buckets it meets.

Pure Python: the worker and the attention's metadata builder both ask it.
"""
from __future__ import annotations

MIN = 2


def pow2(n: int, lo: int = MIN) -> int:
    """The smallest power of two >= ``n`` and >= ``lo``."""
    b = lo
    while b < n:
        b *= 2
    return b


def token_buckets(max_tokens: int, compile_sizes=None) -> tuple[int, ...]:
    """The sizes a step's token count is padded up to (the list's last is ``max_tokens``)."""
    sizes = {int(s) for s in compile_sizes or () if isinstance(s, int) and MIN <= s < max_tokens}
    if not sizes:
        b = MIN
        while b < max_tokens:
            sizes.add(b)
            b *= 2
    sizes.add(max(max_tokens, MIN))
    return tuple(sorted(sizes))


def up(n: int, sizes: tuple[int, ...]) -> int:
    """The first of ``sizes`` (ascending) >= ``n``; ``n`` itself past the last."""
    for s in sizes:
        if s >= n:
            return s
    return n


def for_config(vllm_config) -> tuple[int, ...] | None:
    """The token buckets of an engine whose model is compiled; None in defer mode."""
    from vllm.config import CompilationMode
    cc = vllm_config.compilation_config
    if cc.mode != CompilationMode.STOCK_TORCH_COMPILE:
        return None
    return token_buckets(vllm_config.scheduler_config.max_num_batched_tokens, cc.compile_sizes)
