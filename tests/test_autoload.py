"""``import torch`` registers ``tpu`` through the ``torch.backends`` entry point, without JAX;
deferfuse loads on the first real use. Each case runs in a fresh interpreter that never imports
deferfuse itself (the installed entry point is what this tests)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.modes("strict")   # subprocesses: the fixture's mode does not reach them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD",)}
    env.update(extra)
    return env


def _start(code, **env):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd="/", env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p, timeout=300):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"
    return out


PLAIN = """
import sys
import torch
assert "deferfuse" not in sys.modules and "jax" not in sys.modules, sorted(sys.modules)[:0]
acc = torch.accelerator.current_accelerator()
assert acc == torch.device("tpu"), acc
assert torch.accelerator.is_available() and torch.tpu.is_available()
assert torch.device("tpu:0").type == "tpu"
assert "jax" not in sys.modules, "naming the device imported JAX"
x = torch.arange(6.0).to("tpu")            # the first real use loads deferfuse
assert "deferfuse" in sys.modules and "jax" in sys.modules
tpu_module = torch.tpu
import deferfuse                           # idempotent after autoload
import deferfuse.device
assert torch.tpu is tpu_module is sys.modules["torch.tpu"]
deferfuse.device.register.__doc__          # (nothing registered twice: no error above)
y = (x * 2 + 1).sum()
print(repr(y.item()), x.device, torch.tpu.device_count() >= 1, deferfuse.current_mode())
"""


def test_plain_import_torch_registers_tpu():
    out = _finish(_start(PLAIN))
    value, dev, count, mode = out.split()
    assert float(value) == (torch.arange(6.0) * 2 + 1).sum().item()
    assert dev == "tpu:0" and count == "True" and mode == "defer"


# Each way a script first touches the device loads deferfuse (in a process of its own).
FIRST_USES = {
    "factory": "y = torch.ones(3, device='tpu') * 2",
    "module to": "y = torch.nn.Linear(3, 3).to('tpu').bias.detach() * 0 + 2",
    "torch.tpu": "torch.tpu.manual_seed(0); y = torch.full((3,), 2.0, device='tpu')",
    "torch.accelerator": "torch.accelerator.synchronize(); y = torch.full((3,), 2.0, device='tpu')",
    "torch.Generator": ("g = torch.Generator('tpu').manual_seed(0)\n"
                        "y = torch.rand(3, device='tpu', generator=g) * 0 + 2\n"
                        "assert g.get_offset() == 4 and isinstance(g, torch.Generator)"),
    # two threads at once: one imports deferfuse, the other waits for it
    "two threads": ("import threading\nout = []\n"
                    "ts = [threading.Thread(target=lambda: out.append(torch.full((3,), 2.0).to('tpu')))"
                    " for _ in range(2)]\n"
                    "[t.start() for t in ts]; [t.join() for t in ts]\n"
                    "assert len(out) == 2 and out[1].device.type == 'tpu'; y = out[0]"),
}


def _first_uses(names):
    procs = {}
    for name in names:
        code = FIRST_USES[name]
        procs[name] = _start("import sys, torch\n"
                             "assert 'jax' not in sys.modules\n"
                             f"{code}\n"
                             "assert 'deferfuse' in sys.modules\n"
                             "print(y.device, y.cpu().tolist())\n")
    for name, p in procs.items():
        out = _finish(p)
        assert out.split("\n")[0] == "tpu:0 [2.0, 2.0, 2.0]", (name, out)


def test_first_use_loads_deferfuse():
    _first_uses(["factory", "two threads"])


@pytest.mark.slow
def test_each_first_use_loads_deferfuse():
    # (a process each: importing torch and JAX in five processes costs a minute on 2 cores)
    _first_uses(["module to", "torch.tpu", "torch.accelerator", "torch.Generator"])


def test_autoload_off_and_import_deferfuse():
    # PyTorch's own switch: nothing is registered until the script imports deferfuse.
    out = _finish(_start("""
        import sys, torch
        assert torch.accelerator.current_accelerator() is None
        try:
            torch.device("tpu")
        except RuntimeError as e:
            print("refused", "tpu" in str(e))
        assert "deferfuse" not in sys.modules
        import deferfuse
        print(torch.accelerator.current_accelerator(), (torch.ones(2).to("tpu") + 1).tolist())
        """, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert out.split("\n")[:2] == ["refused True", "tpu [2.0, 2.0]"]


def test_entry_point_is_installed():
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="torch.backends") if e.name == "deferfuse"]
    assert [e.value for e in eps] == ["deferfuse_autoload:autoload"]
