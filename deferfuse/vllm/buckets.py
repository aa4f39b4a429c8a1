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
- the model is compiled with ``dynamic=True`` and without duck sizing, and a decode-only step
  lays out its queries as a step with a prefill does (the longest query padded to 2), so Dynamo
  makes one graph whatever the sizes, traced once, and XLA compiles it once for each
  combination of buckets it meets;
- what made that trace slow is kept out of it: the KV caches are marked static (their sizes
  never change: no symbols for them), and Python floats (norms' epsilons, the attention's
  scale) are specialized from the start (as symbols, Dynamo specialized them at the end of its
  first trace and traced the whole model again);
- the model's graph runs in a region of its own: the runner fences it off (``Cut.FENCE``) from
  the step's input preparation and sampling, whose ops have the step's exact sizes (token and
  request counts); in one region with them, every exact size was a program holding the model.
  Those small regions compile whole at each new exact size, once (a raised
  ``shape_recompile_limit`` around the runner's flushes): with deferfuse's default a size met
  past the limit ran op by op and compiled whole when it came back, so the same requests
  compiled again in their second and third runs.

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
