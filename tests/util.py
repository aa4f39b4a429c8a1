"""Comparison helpers: tpu results against CPU eager, dtype and shape before values; a free port
pair for multi-process tests; the bench's modules (its shared models and workloads)."""
import importlib
import os
import socket
import sys

import torch


def cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(cpu(y) for y in x)
    return x


def assert_same(got, want, atol=1e-5, rtol=1.3e-6, msg=""):
    """``got`` (tpu) matches ``want`` (CPU): type, dtype, shape, then values."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{msg}: {type(got)} vs {type(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, atol, rtol, f"{msg}[{i}]")
        return
    if not isinstance(want, torch.Tensor):
        assert got == want or (got != got and want != want), f"{msg}: {got} != {want}"
        return
    assert isinstance(got, torch.Tensor), f"{msg}: expected a tensor, got {type(got)}"
    assert got.device.type == "tpu", f"{msg}: result on {got.device}, expected tpu"
    assert got.dtype == want.dtype, f"{msg}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol, equal_nan=True, msg=msg or None)


def to_tpu(x):
    """``x`` with every tensor in it (lists and tuples included) moved to tpu."""
    if isinstance(x, torch.Tensor):
        return x.to("tpu")
    if isinstance(x, (list, tuple)):
        return type(x)(to_tpu(y) for y in x)
    return x


def train_beside(ref, model, steps=3):
    """``steps`` SGD steps of a CPU model ``ref`` and its tpu copy ``model`` on the same data."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    x = torch.randn(5, 4)
    for _ in range(steps):
        for m, o, xi in ((ref, opts[0], x), (model, opts[1], x.to("tpu"))):
            loss = m(xi).square().mean()
            o.zero_grad()
            loss.backward()
            o.step()


def free_port() -> int:
    """A port p with p + 1 free too (JAX's coordinator listens on MASTER_PORT + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def bench_module(name: str):
    """``bench/NAME.py`` imported (``models``: the small models the benches and the tests share;
    ``workloads``: the paired bench's workloads), with ``bench/`` on the path while it imports."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
