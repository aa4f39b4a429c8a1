"""``torch.tpu.Stream``, ``Event``, ``current_stream``, ``stream``: what code written for CUDA
streams (FSDP2's all-gather and reduce-scatter streams, overlap tricks) calls.

NOTE [one stream]: a tpu value is a JAX array, and JAX orders every computation after the
computations of its inputs, whatever Python thread or "stream" issued it. So one stream per device
is all there is: waits between streams and events are already true and cost nothing, and
``synchronize()`` waits for everything issued so far (a sync point in defer mode, as
``torch.tpu.synchronize()``).
"""
from __future__ import annotations

import contextlib

import torch

from .engine import engine
from .scheduler.policy import Sync
from .runtime import execute


def _synchronize() -> None:
    engine.sync(Sync.SYNCHRONIZE)
    execute.wait_all()


def _device(device):
    if device is None:
        return torch.device("tpu", torch.tpu.current_device())
    if isinstance(device, int):
        return torch.device("tpu", device)
    return torch.device(device)


class Stream(torch.Stream):
    """A tpu stream (see NOTE [one stream]): ``Stream(device=None, priority=0)``."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=_device(device), priority=priority)

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def synchronize(self) -> None:
        _synchronize()

    def query(self) -> bool:
        return True

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event


class Event(torch.Event):
    """A tpu event (see NOTE [one stream]): ``Event(enable_timing=False, blocking=False, ...)``."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False, device=None):
        return super().__new__(cls, device=_device(device), enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        super().record(stream if stream is not None else current_stream())
        return self

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronize()


def current_stream(device=None) -> torch.Stream:
    """The device's one stream (see NOTE [one stream])."""
    return torch.accelerator.current_stream(_device(device))


default_stream = current_stream


def set_stream(stream) -> None:
    """Nothing to switch: every stream is the device's one stream (NOTE [one stream])."""


def stream(s):
    """``with torch.tpu.stream(s):`` runs its block on ``s``: the device's one stream."""
    return contextlib.nullcontext(s)


def install(module) -> None:
    """Add the stream API to the ``torch.tpu`` module."""
    for name in ("Stream", "Event", "current_stream", "default_stream", "set_stream", "stream"):
        setattr(module, name, globals()[name])
