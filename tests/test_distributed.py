"""torch.distributed on tpu: the ``tpu`` process group, DDP, DTensor, FSDP2, DCP and failures.

Multi-process tests start 2 or 4 processes of tests/dist_worker.py on loopback, with the
variables torchrun sets and one CPU JAX device each. They carry the ``procs`` mark: ``make
test-procs`` runs the short ones (CI runs it after ``make test``), ``make test-dist`` all of them;
the default run leaves them out. The in-process tests use a group of one process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import deferfuse
from util import free_port, train_beside

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")


def once(test):
    """A multi-process test: the pytest process does nothing on tpu, so it runs in one mode; it is
    kept out of the default run (``procs``: ``make test-procs``)."""
    return pytest.mark.procs(pytest.mark.modes("strict")(test))



def _env(rank, n, port, extra=None):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)          # one CPU device per process
    env.update(extra or {})
    return env


def launch(n, *args, extra_env=None, timeout=400, expect_ok=True, on_start=None):
    """Run ``dist_worker.py *args`` in ``n`` processes; returns [(returncode, stdout, stderr)]."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, *map(str, args)],
                              env=_env(r, n, port, extra_env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    if on_start is not None:
        on_start(procs)
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            so, se = p.communicate()
            raise AssertionError(f"rank {procs.index(p)} did not finish in {timeout} s:\n"
                                 f"{so[-3000:]}\n{se[-3000:]}")
        out.append((p.returncode, so, se))
    if expect_ok:
        for r, (rc, so, se) in enumerate(out):
            assert rc == 0, f"rank {r} exited with {rc}:\n{so[-3000:]}\n{se[-6000:]}"
    return out


def results(out):
    res = []
    for rc, so, se in out:
        line = [ln for ln in so.splitlines() if ln.startswith("RESULT ")]
        assert line, f"no result:\n{so[-2000:]}\n{se[-4000:]}"
        res.append(json.loads(line[-1][len("RESULT "):]))
    return res


# --------------------------------------------------------------------------- default run
@once
def test_collectives_two_processes():
    """Every collective, ReduceOp and dtype on tpu equals the same collective through gloo on CPU
    tensors (defer mode: each collective is a sync point)."""
    res = results(launch(2, "collectives", "defer"))
    assert all(r["checked"] == res[0]["checked"] > 30 for r in res)


@once
def test_ddp_two_processes_matches_cpu_training():
    """DDP trains the small GPT for 20 steps on 2 processes as CPU trains it on the global batch."""
    res = results(launch(2, "ddp", "defer"))
    for r in res:
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 2e-5
        assert r["syncs"].get("collective", 0) >= 20     # a sync point at each collective
    assert res[0]["syncs"] == res[1]["syncs"]            # every rank cut its traces alike


@once
@pytest.mark.slow
def test_dtensor_random_init_two_ranks_equals_one_device():
    """Parameters initialised through DTensor's random ops (uniform_, normal_, trunc_normal_,
    randn; sharded and replicated; from the device's generator and from an explicit
    torch.Generator("tpu")) from one seed on 2 ranks equal the same draws on one device
    (each rank checks), and the ranks' generators end alike: the tpu generator's (seed, offset)
    state is what DTensor's tracker expects. (One rank: test_one_process_dtensor_random_init.)"""
    two = results(launch(2, "rng", "defer"))
    assert two[0]["sums"] == two[1]["sums"] and two[0]["state"] == two[1]["state"]


@once
def test_killed_rank_is_named(tmp_path):
    """A rank killed with SIGKILL makes the other fail with a DistributedError naming it, within
    the timeout, never a hang."""
    marker = str(tmp_path / "kill-me")
    killed_at = []

    def killer(procs):
        deadline = time.monotonic() + 200
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        killed_at.append(time.monotonic())
    out = launch(2, "fault", "defer", "kill", expect_ok=False, on_start=killer,
                 extra_env={"DIST_TEST_MARKER": marker, "DEFERFUSE_DIST_TIMEOUT": "10"})
    (rc0, so0, se0), (rc1, _, _) = out
    assert rc1 == -signal.SIGKILL
    assert rc0 != 0, so0
    assert "DistributedError" in se0 and "rank 1 stopped sending heartbeats" in se0, se0[-3000:]
    assert time.monotonic() - killed_at[0] < 60


def torchrun(tmp_path, script: str, *args, n=2, extra_env=None, timeout=300, check=True):
    """Run ``script`` (its text) under ``python -m torch.distributed.run --nproc_per_node=n``."""
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.update(extra_env or {})
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                        f"--master_port={free_port()}", str(path), *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


# A script that never imports deferfuse: the torch.backends entry point registered the tpu
# process group at import torch; making the group loads deferfuse and starts JAX's runtime.
NO_IMPORT = """
import os, sys, torch, torch.distributed as dist
spelling = sys.argv[1]
assert "deferfuse" not in sys.modules and "jax" not in sys.modules
if spelling == "default":
    dist.init_process_group()                 # tpu is the accelerator: its default backend
elif spelling == "ray":                       # Ray Train: MASTER_* set, RANK/WORLD_SIZE not yet
    assert "RANK" not in os.environ and "MASTER_PORT" in os.environ
    dist.init_process_group("tpu_dist", init_method="env://", rank=int(sys.argv[2]),
                            world_size=2)
elif spelling == "tcp":                       # no variables at all
    assert "MASTER_PORT" not in os.environ
    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{sys.argv[3]}",
                            rank=int(sys.argv[2]), world_size=2)
else:
    dist.init_process_group(spelling)
from jax._src import distributed
assert distributed.global_state.client is not None, "JAX's distributed runtime did not start"
from deferfuse.distributed.group import ProcessGroupTPU
assert isinstance(dist.group.WORLD, ProcessGroupTPU), dist.group.WORLD
r, n = dist.get_rank(), dist.get_world_size()
x = torch.randn(5, 3, generator=torch.Generator().manual_seed(r))
t = x.to("tpu")
dist.all_reduce(t)
c = x.clone()
dist.all_reduce(c)                            # a CPU tensor: the group's gloo
want = sum(torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(n))
torch.testing.assert_close(t.cpu(), c)
torch.testing.assert_close(c, want)
assert t.device == torch.device("tpu:0") and t.dtype == torch.float32
print("NOIMPORT-OK", r, flush=True)
dist.destroy_process_group()
"""


@once
@pytest.mark.slow_params("tpu_dist", "default")     # the same registration as "tpu": slow
@pytest.mark.parametrize("spelling", ["tpu", "tpu_dist", "default"])
def test_torchrun_without_import_deferfuse(tmp_path, spelling):
    """init_process_group("tpu"), ("tpu_dist") and () in a script that never imports deferfuse,
    under torchrun: a 2-rank all_reduce equals gloo's on CPU tensors and the CPU sum."""
    p = torchrun(tmp_path, NO_IMPORT, spelling)
    assert p.stdout.count("NOIMPORT-OK") == 2, p.stdout[-2000:]


@once
@pytest.mark.slow_params("tcp")
@pytest.mark.parametrize("how", ["ray", "tcp"])
def test_rank_given_to_init_process_group(tmp_path, how):
    """Launchers that give the rank and size to init_process_group rather than in RANK and
    WORLD_SIZE (Ray Train sets only MASTER_ADDR/MASTER_PORT first; init_method="tcp://" with no
    variables): the group starts JAX's runtime with them (coordinator on the store's port + 1)."""
    path = tmp_path / "script.py"
    path.write_text(NO_IMPORT)
    port = free_port()
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                            "MASTER_PORT", "XLA_FLAGS", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
        env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        if how == "ray":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(path), how, str(r), str(port)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=str(tmp_path)))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=200))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0 and "NOIMPORT-OK" in so, so[-2000:] + se[-4000:]


@once
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_p2p_in_any_order(n):
    """isend before irecv on every rank and a batch_isend_irecv ring, as through gloo; two ranks
    that both block in send first are told so (2 ranks), not hung."""
    res = results(launch(n, "p2p", "defer", extra_env={"DEFERFUSE_DIST_TIMEOUT": "20"}))
    if n == 2:
        assert all("each waits on a request the other has not matched" in r["error"] for r in res)


# The end of the signal tests' workers: say they are ready, then run on (until killed). Both ranks
# write into torchrun's one stdout: the line goes out in one write (print's text and its end are two
# writes unbuffered, and another rank's line could land between them: "READY 0 1READY 1 2").
_RUN_ON = """
print(f"READY {r} {os.getpid()}\\n", end="", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 100:
    time.sleep(0.05)
print(f"STILL-RUNNING {r}", flush=True)
"""


SIGNALLED = """
import os, signal, sys, time, torch, torch.distributed as dist
if sys.argv[1] == "handler":                  # the program's own handler, installed first
    def handler(sig, frame):
        raise RuntimeError(f"stopping on signal {sig}")
    signal.signal(signal.SIGTERM, handler)
dist.init_process_group("tpu")
r = dist.get_rank()
t = torch.full((4,), float(r + 1), device="tpu")
dist.all_reduce(t)
assert t.cpu().tolist() == [3.0] * 4
""" + _RUN_ON


@once
@pytest.mark.slow_params("handler")
@pytest.mark.parametrize("how,sig", [("default", "SIGTERM"), ("handler", "SIGTERM"),
                                     pytest.param("default", "SIGINT", marks=pytest.mark.slow)])
def test_signal_ends_a_rank_under_torchrun(tmp_path, how, sig):
    """A signal to one rank of a 2-rank torchrun job ends it as it ends a CPU process (the default
    action, KeyboardInterrupt, or the program's handler), and torchrun then ends the job within
    seconds: JAX's preemption service no longer swallows SIGTERM, and a rank that raised does not
    wait at exit for JAX's runtime to shut down."""
    import re
    path = tmp_path / "script.py"
    path.write_text(SIGNALLED)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_ENABLE_PREEMPTION_SERVICE", None)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", str(path), how], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=str(tmp_path))
    pids, seen = {}, []
    try:
        for line in p.stdout:
            seen.append(line)
            for m in re.finditer(r"READY (\d) (\d+)", line):   # (two on a line, as well)
                pids[int(m.group(1))] = int(m.group(2))
            if len(pids) == 2:
                break
        assert len(pids) == 2, "".join(seen)[-4000:]
        t0 = time.monotonic()
        os.kill(pids[1], getattr(signal, sig))
        rest, _ = p.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    out = "".join(seen) + rest
    assert p.returncode != 0 and "STILL-RUNNING" not in out, out[-4000:]
    assert "SIGTERM caught" not in out, out[-4000:]
    assert took < 15, f"the job took {took:.1f} s to end:\n{out[-4000:]}"
    if how == "handler":
        assert "RuntimeError: stopping on signal 15" in out, out[-4000:]
    elif sig == "SIGINT":
        assert "KeyboardInterrupt" in out, out[-4000:]
    else:
        assert "exitcode  : -15" in out and "Signal 15 (SIGTERM) received" in out, out[-4000:]


SHUTDOWN = """
import os, signal, sys, time, torch, torch.distributed as dist
dist.init_process_group("tpu")
r = dist.get_rank()
t = torch.full((4,), float(r + 1), device="tpu")
dist.all_reduce(t)
assert t.cpu().tolist() == [3.0] * 4
if r == 1:
    def handler(sig, frame):
        raise RuntimeError(f"stopping on signal {sig}")
    signal.signal(signal.SIGTERM, handler)
    if sys.argv[1] == "hung":
        # JAX's shutdown never returning, as it hung under torchrun (issue 32)
        from jax._src import distributed

        class Hung:
            def __init__(self, client):
                self.client = client

            def __getattr__(self, name):
                return getattr(self.client, name)

            def shutdown(self):
                time.sleep(3600)
        distributed.global_state.client = Hung(distributed.global_state.client)
""" + _RUN_ON


@once
@pytest.mark.slow
@pytest.mark.parametrize("how", ["waits", "hung"])
def test_a_rank_that_raised_on_sigterm_exits_within_the_timeout(tmp_path, how):
    """NOTE [signals] in runtime/cluster.py: rank 1 gets SIGTERM, its handler raises, and rank 0
    runs on (no launcher ends it). Rank 1 exits within the distributed timeout (5 s here) plus
    its start of exit, whether JAX's shutdown waits for rank 0 at its barrier (``waits``) or never
    returns (``hung``: the bound is deferfuse's own, which says so); rank 0 is left running."""
    path = tmp_path / "script.py"
    path.write_text(SHUTDOWN)
    port = free_port()
    extra = {"DEFERFUSE_DIST_TIMEOUT": "5"}
    procs = [subprocess.Popen([sys.executable, str(path), how], env=_env(r, 2, port, extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        pid = procs[1].pid
        for line in procs[1].stdout:
            if line.startswith("READY"):
                break
        else:
            raise AssertionError(procs[1].communicate()[1][-4000:])
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        try:
            _, err = procs[1].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            procs[1].kill()
            raise AssertionError(f"rank 1 still running 60 s after SIGTERM ({how})")
        took = time.monotonic() - t0
        assert procs[0].poll() is None, procs[0].communicate()[1][-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[1].returncode == 1 and "RuntimeError: stopping on signal 15" in err, err[-4000:]
    assert took < 5 + 10, f"rank 1 took {took:.1f} s to exit:\n{err[-4000:]}"
    if how == "hung":
        assert "did not shut down within 5 s" in err, err[-4000:]


# --------------------------------------------------------------------------- slow: the rest
@once
@pytest.mark.slow
@pytest.mark.parametrize("n,mode", [(2, "strict"), (4, "defer")])
def test_collectives(n, mode):
    res = results(launch(n, "collectives", mode))
    assert all(r["checked"] == res[0]["checked"] for r in res)


@once
@pytest.mark.slow
@pytest.mark.parametrize("n,mode,arg,env", [
    (2, "strict", "", {}), (4, "defer", "", {}), (2, "defer", "bucket_view", {}),
    (2, "defer", "", {"DEFERFUSE_DIST_WAIT": "async", "DEFERFUSE_DIST_CHECK": "0"}),
    (2, "defer", "static_graph", {}), (2, "strict", "find_unused", {})])
def test_ddp(n, mode, arg, env):
    """``static_graph`` and ``find_unused``: DDP stages its map of used parameters in pinned memory
    in backward (NOTE [pinned memory] in deferfuse/_tpu_hooks.cpp)."""
    for r in results(launch(n, "ddp", mode, arg, extra_env=env)):
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 2e-5


@once
@pytest.mark.slow
@pytest.mark.parametrize("n,mode,arg", [(2, "defer", ""), (2, "strict", ""), (4, "defer", ""),
                                        (2, "defer", "mp"), (4, "defer", "mp")])
def test_fsdp2(n, mode, arg):
    """fully_shard on each block and the root of the GPT (and a bf16 MixedPrecisionPolicy)."""
    for r in results(launch(n, "fsdp", mode, arg)):
        assert r["param_err"] <= (2e-3 if arg else 2e-5)


@once
@pytest.mark.slow
@pytest.mark.parametrize("n,mode", [(2, "defer"), (4, "defer"), (2, "strict")])
def test_dtensor_and_tensor_parallel(n, mode):
    for r in results(launch(n, "tp", mode)):
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 2e-5


@once
@pytest.mark.slow
@pytest.mark.parametrize("n,mode", [(2, "defer"), (2, "strict"), (4, "defer")])
def test_compiled_tensor_parallel(n, mode):
    """torch.compile(backend="tpu") of functional collectives and of a tensor-parallel MLP:
    each graph one program over the group (NOTE [collectives in programs]), values and gradients
    equal to gloo's and CPU's, no graph run op by op (tests/dist_worker.py's scenario asserts);
    a graph writing into a cache input is given its buffer (NOTE [donation in graphs over a
    group]), the cache equal to gloo's."""
    for r in results(launch(n, "tp_compiled", mode)):
        assert r["grad_err"] <= 1e-5 and r["graph_compiles"] == 3, r
        assert r["collectives"]["compiled_graph"] == 7, r["collectives"]
        assert r["kv_donated"] >= 3 * 32 * 4, r["kv_donated"]


@once
def test_compiled_packed_boundaries_agree_across_ranks():
    """Varlen attention all-reduced in a compiled graph, on 2 ranks packing other numbers of
    documents: after the first call, each rank's boundaries are padded to the same bucket, so the
    ranks agree and every call runs as one program over the group, none op by op (NOTE [packed
    boundaries], NOTE [collectives in programs]); values against CPU and gloo (the scenario)."""
    for r in results(launch(2, "packed_graph", "defer")):
        assert r["op_by_op"] == 0 and r["calls"] == 4 and r["padded"] >= 3, r


@once
@pytest.mark.slow
def test_dcp_saves_and_loads_sharded_fsdp2(tmp_path):
    res = results(launch(2, "dcp", "defer", str(tmp_path / "ckpt")))
    assert any(f.endswith(".distcp") for f in res[0]["files"])


@once
@pytest.mark.slow
@pytest.mark.parametrize("arg", ["", "device_id"])
def test_init_process_group_without_backend_name(arg):
    assert "tpu" in results(launch(2, "noname", "defer", arg))[0]["backend"]


@once
@pytest.mark.slow
def test_two_dimensional_mesh():
    results(launch(4, "mesh2d", "defer"))


@once
@pytest.mark.slow
@pytest.mark.parametrize("kind,words", [
    ("raise", "rank 1 failed: ValueError: rank 1 broke on purpose"),
    ("exit", "rank 1 exited"),
    ("hang", "rank(s) 1 did not reach it within 8 s"),
    ("mismatch", "ranks disagree on all_reduce"),
    ("die_inside", "rank 1 stopped sending heartbeats"),
])
def test_failing_rank_is_named(kind, words):
    t0 = time.monotonic()
    out = launch(2, "fault", "defer", kind, expect_ok=False,
                 extra_env={"DEFERFUSE_DIST_TIMEOUT": "8"})
    rc0, so0, se0 = out[0]
    assert rc0 != 0 and "DistributedError" in se0 and words in se0, se0[-3000:]
    if kind == "mismatch":      # every rank says so, with both ranks' calls and their traces
        assert out[1][0] != 0 and "rank 0: all_reduce(sum) float32[4]" in out[1][2]
        assert "rank 1: all_reduce(sum) float32[8]" in out[1][2]
        assert out[1][2].count("after a recorded trace of") >= 2, out[1][2][-3000:]
    assert time.monotonic() - t0 < 120


@once
@pytest.mark.slow
def test_torchrun(tmp_path):
    """``torchrun --nproc_per_node=2`` a script that calls init_process_group("tpu")."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, deferfuse, torch.distributed as dist\n"
        "dist.init_process_group('tpu')\n"
        "t = torch.full((2,), float(dist.get_rank() + 1), device='tpu')\n"
        "dist.all_reduce(t)\n"
        "assert t.cpu().tolist() == [3.0, 3.0], t\n"
        "print('TORCHRUN-OK', dist.get_rank(), flush=True)\n"
        "dist.destroy_process_group()\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert p.stdout.count("TORCHRUN-OK") == 2


# --------------------------------------------------------------------------- one process
def test_one_process_group(group, tpu_mode):
    """A group of one: every collective is the identity (or its reduction of one value)."""
    x = torch.arange(6.).reshape(2, 3)
    t = x.to("tpu")
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    dist.broadcast(t, 0)
    assert torch.equal(t.cpu(), x)
    out = torch.empty(2, 3, device="tpu")
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out, t * 2)
    assert torch.equal(out.cpu(), x * 2)
    assert dist.get_backend() == "tpu"
    c = torch.ones(2)
    dist.all_reduce(c)          # a CPU tensor goes to the group's gloo
    assert torch.equal(c, torch.ones(2))
    import torch.distributed._functional_collectives as fc
    y = fc.wait_tensor(fc.all_reduce(t, "sum", group))
    # a tpu tensor itself (no AsyncCollectiveTensor around it), of either representation
    from deferfuse.tensor import TpuTensor, is_tpu
    assert torch.equal(y.cpu(), x) and is_tpu(y) and type(y) in (TpuTensor, torch.Tensor)
    assert deferfuse.metrics()["collectives"]["all_reduce"] >= 2


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_one_process_compiled_graph_with_collectives(group, tpu_mode):
    """A compiled graph holding functional collectives runs as one program over the group
    (NOTE [collectives in programs]), not op by op, equal to CPU; a second call compiles nothing.
    (DTensor issues no collectives on a mesh of one; two processes and tensor parallelism:
    test_compiled_tensor_parallel.)"""
    import torch.distributed._functional_collectives as fc

    def f(x):
        y = fc.wait_tensor(fc.all_reduce(x * 2, "sum", group))
        return y.relu(), fc.wait_tensor(fc.all_gather_tensor(x, 0, group)).sum(0)
    torch._dynamo.reset()               # (the other mode's run compiled this function already)
    cf = torch.compile(f, backend="tpu")
    for _ in range(2):
        x = torch.randn(3, 4)
        got = cf(x.to("tpu"))
        for g, w in zip(got, ((x * 2).relu(), x.sum(0))):
            assert g.dtype == w.dtype and g.shape == w.shape and g.device.type == "tpu"
            torch.testing.assert_close(g.cpu(), w)
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0, m["graph_fallback_reasons"]
    assert m["graphs_with_collectives"] == 1 and m["graph_compiles"] == 1, m
    assert m["collectives"]["compiled_graph"] == 2
    assert "one program over a process group: 1" in deferfuse.report()


@pytest.mark.slow_params("strict")   # defer only in the default run
def test_one_process_compiled_graph_donates_what_it_overwrites(group, tpu_mode):
    """A compiled graph with collectives that writes into an input (a KV cache, as vLLM's
    attention does) gets that input's buffer (NOTE [donation in graphs over a group]): no copy
    of the cache each call. Values, the cache included, equal CPU's over three calls; a clone
    taken before a call keeps the old values; with the memory planner off nothing is donated."""
    import torch.distributed._functional_collectives as fc

    def f(cache, idx, x):
        cache.index_copy_(0, idx, x)
        return fc.wait_tensor(fc.all_reduce(cache.sum(0) * 2, "sum", group))
    cf = torch.compile(f, backend="tpu")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 4, generator=g)
    cache = ref.to("tpu")
    nbytes = cache.numel() * cache.element_size()
    for step in range(3):
        idx, x = torch.tensor([step, 7 - step]), torch.randn(2, 4, generator=g)
        snap = cache.clone()
        before = deferfuse.metrics()["donated_bytes"]
        old = ref.clone()
        out = cf(cache, idx.to("tpu"), x.to("tpu"))
        want = f(ref, idx, x)           # on CPU: the group's gloo
        assert deferfuse.metrics()["donated_bytes"] - before >= nbytes
        for got, w in ((out, want), (cache, ref), (snap, old)):
            assert got.dtype == w.dtype and got.shape == w.shape and got.device.type == "tpu"
            torch.testing.assert_close(got.cpu(), w, rtol=0, atol=0)
    m = deferfuse.metrics()
    assert m["graphs_run_eagerly"] == 0 and m["graph_calls_op_by_op"] == 0, m
    assert m["collectives"]["compiled_graph"] == 3
    with deferfuse.override(memory_planner=False):
        before = deferfuse.metrics()["donated_bytes"]
        out = cf(cache, torch.tensor([1], device="tpu"), torch.ones(1, 4, device="tpu"))
        want = f(ref, torch.tensor([1]), torch.ones(1, 4))
        torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
        torch.testing.assert_close(cache.cpu(), ref, rtol=0, atol=0)
        assert deferfuse.metrics()["donated_bytes"] == before


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_one_process_fsdp2(group, tpu_mode):
    """fully_shard on a group of one: frees and reallocates parameter storage (resize_), uses
    torch.tpu streams and events; trains as CPU does."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.load_state_dict(ref.state_dict())
    model = model.to("tpu")
    fully_shard(model[0])
    fully_shard(model)
    train_beside(ref, model)
    got = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v)


@pytest.mark.parametrize("how", ["static_graph", "find_unused_parameters"])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_one_process_ddp_stages_its_map_in_pinned_memory(group, tpu_mode, how):
    """DDP with ``static_graph=True`` (TorchRec's default) or ``find_unused_parameters=True``
    copies its map of used parameters to the device through pinned memory in backward, which
    PyTorch's Python device hooks cannot allocate (NotImplementedError
    ``getPinnedMemoryAllocator``): deferfuse's C++ hooks can (NOTE [pinned memory]). A model with
    an unused parameter trains as on CPU, 3 steps."""
    import deferfuse_autoload
    from torch.nn.parallel import DistributedDataParallel as DDP
    assert deferfuse_autoload.LOADER.native_hooks, (
        "deferfuse/_tpu_hooks.cpp is not built for this torch: rebuild with "
        "`python setup.py build_ext --inplace`")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = (torch.nn.Linear(4, 6), torch.nn.Linear(6, 2),
                                           torch.nn.Linear(2, 2))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    model = DDP(model.to("tpu"), **{how: True})
    train_beside(ref, model)
    got = model.module.state_dict()
    for k, v in ref.state_dict().items():
        assert got[k].device.type == "tpu"
        torch.testing.assert_close(got[k].cpu(), v)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_one_process_dtensor_random_init(group, tpu_mode):
    """DTensor's random ops (its OffsetBasedRNGTracker reads and moves the tpu generator's 16-byte
    (seed, offset) state) on a mesh of one: the same numbers as plain draws from the same seed,
    and the device's generator ends where the plain draws leave it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import torch.distributed.tensor as dtensor
    mesh = init_device_mesh("tpu", (1,))

    def draws(distributed):
        torch.manual_seed(7)

        def empty(placements):
            t = torch.empty(8, 6, device="tpu")
            return distribute_tensor(t, mesh, placements) if distributed else t
        out = [torch.nn.init.trunc_normal_(empty([Shard(0)]), std=0.02),
               empty([Replicate()]).uniform_(-1, 1), empty([Shard(1)]).normal_(),
               dtensor.randn(8, 6, device_mesh=mesh, placements=[Shard(0)]) if distributed
               else torch.randn(8, 6, device="tpu")]
        out = [o.full_tensor() if distributed else o for o in out]
        return [o.cpu() for o in out], torch.tpu.get_rng_state()

    got, state = draws(True)
    want, want_state = draws(False)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape == (8, 6)
        assert torch.equal(g, w)
    assert torch.equal(state, want_state)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_one_process_dtensor_random_ops_take_a_tpu_generator(group, tpu_mode):
    """A DTensor random op with ``generator=torch.Generator("tpu")`` (NOTE [generators in
    DTensor] in deferfuse/generator.py): the numbers a plain tensor draws from a generator of the
    same seed, the generator moved as far, the device's own generator untouched (it failed an
    assertion inside DTensor: it was given CPU's 5056-byte generator state)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("tpu", (1,))
    torch.manual_seed(3)
    before = torch.tpu.get_rng_state()

    def draws(distributed):
        g = torch.Generator(device="tpu").manual_seed(11)

        def empty():
            t = torch.empty(8, 6, device="tpu")
            return distribute_tensor(t, mesh, [Shard(0)]) if distributed else t
        out = [empty().uniform_(-1, 1, generator=g), empty().normal_(generator=g),
               empty().bernoulli_(0.3, generator=g)]
        out = [o.full_tensor() if distributed else o for o in out]
        return [o.cpu() for o in out], g.get_state()

    got, got_state = draws(True)
    want, want_state = draws(False)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape == (8, 6)
        assert torch.equal(g, w)
    assert torch.equal(got_state, want_state) and int(got_state[8:].view(torch.int64)) > 0
    assert torch.equal(torch.tpu.get_rng_state(), before)
    # The generator's own stream, 48 values on (the uniform_ draw), without DTensor
    assert torch.equal(got[1], torch.empty(8, 6, device="tpu").normal_(
        generator=torch.Generator("tpu").manual_seed(11).set_offset(48)).cpu())


def test_storage_resize(tpu_mode):
    """untyped_storage(): size, resize_(0) frees the value, resize_ back allocates it."""
    t = torch.arange(6., device="tpu")
    v = t.view(2, 3)
    st = t.untyped_storage()
    assert st.size() == 24 and st.data_ptr() == v.untyped_storage().data_ptr() != 0
    st.resize_(0)
    assert t.untyped_storage().size() == 0 and st.data_ptr() == 0
    st.resize_(24)
    t.copy_(torch.ones(6))
    assert torch.equal(v.cpu(), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="resized to 0"):
        st.resize_(8)


def test_streams_and_events(tpu_mode):
    s = torch.tpu.Stream(priority=-1)
    assert isinstance(s, torch.Stream) and s.device.type == "tpu"
    x = torch.ones(3, device="tpu")
    with torch.tpu.stream(s):
        y = x * 2
    e = s.record_event()
    torch.tpu.current_stream().wait_event(e)
    torch.tpu.current_stream().wait_stream(s)
    e.synchronize()
    s.synchronize()
    assert e.query() and torch.equal(y.cpu(), torch.full((3,), 2.))
    assert torch.tpu.Event().record().query()


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_chunk_cat_and_split_copy(tpu_mode):
    """The lowerings FSDP2's copies use, against CPU (out= forms included)."""
    from util import assert_same
    x = torch.randn(4, 10)
    outs = [torch.empty(4, 3), torch.empty(4, 7)]
    touts = [o.to("tpu") for o in outs]
    torch.split_with_sizes_copy(x, [3, 7], dim=1, out=outs)
    torch.split_with_sizes_copy(x.to("tpu"), [3, 7], dim=1, out=touts)
    assert_same(touts, outs)
    for ts, dim, chunks in (([torch.randn(5, 3), torch.randn(3, 3)], 0, 2),
                            ([torch.randn(5, 3), torch.randn(3, 3)], 0, 3),
                            ([torch.randn(2, 5), torch.randn(2, 3)], 1, 2),
                            ([torch.randn(2, 5), torch.randn(2, 3)], -1, 3)):
        assert_same(torch._chunk_cat([t.to("tpu") for t in ts], dim, chunks),
                    torch._chunk_cat(ts, dim, chunks))
    with pytest.raises(RuntimeError, match="same sizes of 0,...,dim-1"):
        torch._chunk_cat([torch.randn(5, 3, device="tpu"), torch.randn(3, 4, device="tpu")], 1, 2)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_foreach_into_views_of_one_buffer(tpu_mode):
    """In-place foreach ops on slices of one buffer (FSDP2 copies parameters into one; an
    optimizer over views of a flat buffer) write every slice, as on CPU."""
    from util import assert_same
    for make in (lambda b: list(torch.split(b.narrow(0, 2, 6), [2, 4])),
                 lambda b: [b[2:4], b[6:10]], lambda b: [b[8:], b[:3]]):
        base = torch.linspace(-1, 1, 10)
        srcs = [torch.arange(4.)[:len(v)] + 1 for v in make(base)]
        got, want = base.to("tpu"), base.clone()
        for b, src in ((got, [s.to("tpu") for s in srcs]), (want, srcs)):
            views = make(b)
            torch._foreach_copy_(views, src)
            torch._foreach_add_(views, src, alpha=2)
            torch._foreach_mul_(views, [3.0, 0.5])
            torch._foreach_addcmul_(views, src, src, value=0.25)
            torch._foreach_lerp_(views, src, 0.5)
        assert_same(got, want)
