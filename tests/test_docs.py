"""The documentation people read runs: every ```python block of README.md and docs/*.md (a page's
blocks in order, in one namespace, in defer mode, as a reader would paste them), the performance
table is the latest benchmark run's, and the site builds with warnings as errors."""
import glob
import os
import re
import subprocess
import sys

import pytest

import deferfuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SKIP = re.compile(r"#\s*docs-test:\s*skip\s*\((?P<why>[^)]+)\)")


def blocks(path):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def test_pages_have_code_to_run():
    assert sum(len(blocks(p)) for p in PAGES) >= 5
    for p in PAGES:
        for b in blocks(p):
            first = b.splitlines()[0] if b.strip() else ""
            if "docs-test" in first:
                assert SKIP.match(first), f"{p}: a skip marker needs a reason: {first}"


@pytest.mark.modes("defer")
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_code_blocks_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__docs__"}
    for i, code in enumerate(blocks(page)):
        if SKIP.match(code.splitlines()[0]):
            continue
        try:
            exec(compile(code, f"{page}[block {i}]", "exec"), ns)
        except Exception as e:
            raise AssertionError(f"{page}, python block {i} raised {type(e).__name__}: {e}") from e
    deferfuse.sync()
    check = CHECKS.get(page)
    if check is not None:
        check(ns, capsys.readouterr().out)


def _readme(ns, out):
    assert ns["device"].type == "tpu" and ns["state"]["0.weight"].device.type == "tpu"
    losses = [float(line.split()[1]) for line in out.splitlines()[:5]]
    assert losses[-1] < losses[0], losses


def _pytorch_on_tpu(ns, out):
    import torch
    assert ns["ck"]["model"]["weight"].device.type == "tpu"
    assert ns["on_cpu"]["model"]["weight"].device.type == "cpu"
    assert isinstance(ns["whole"].weight, torch.nn.Parameter)
    assert "index 5 is out of bounds for dimension 1 with size 4 (aten.gather" in out
    assert "Scaled [40.0, 50.0]" in out and isinstance(ns["s"], ns["Scaled"])
    assert ns["props"].total_memory == torch.tpu.mem_get_info(0)[1]


def _troubleshooting(ns, out):
    assert ns["m"]["compiles"] >= 1 and ns["m"]["cache_hits"] >= 1 and "sync" in ns["text"]


# What a reader is told the blocks do.
CHECKS = {"README.md": _readme, "docs/pytorch-on-tpu.md": _pytorch_on_tpu,
          "docs/troubleshooting.md": _troubleshooting}


@pytest.mark.modes("strict")
def test_performance_table_is_the_latest_run():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "docs_table.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.modes("strict")
def test_site_builds_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                        "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
