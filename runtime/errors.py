"""Exceptions raised by the runtime (re-exported by ``deferfuse.errors``)."""


class LoweringError(NotImplementedError):
    """An aten op has no lowering to JAX. The dispatcher turns it into a CPU fallback (counted)."""

    def __init__(self, op, why: str = "no lowering"):
        super().__init__(f"{op}: {why}")
        self.op = op


class RegionError(RuntimeError):
    """An op failed inside a fused region; the message names the op and the user's source line."""
