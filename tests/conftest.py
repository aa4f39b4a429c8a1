"""Every test runs in each mode it supports: strict and defer unless ``@pytest.mark.modes(...)``
names others. Tests compare tpu results with CPU eager PyTorch on the same inputs."""

import os
import tempfile

# Each run starts from an empty program store (tests count compiles; a store left by an earlier run
# of the same code would answer them from disk). Set before ``import torch``, which autoloads
# deferfuse and reads the setting.
# Under pytest-xdist (``-n 2``) each worker process gets its own store too: workers inherit the
# controller's environment, and one worker's programs would answer another's compile counts.
_OWN_CACHE = None
if "DEFERFUSE_CACHE_DIR" not in os.environ or os.environ.get("DEFERFUSE_TESTS_OWN_CACHE"):
    _OWN_CACHE = os.environ["DEFERFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="deferfuse-tests-")
    os.environ["DEFERFUSE_TESTS_OWN_CACHE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import deferfuse  # noqa: E402

ALL_MODES = ("strict", "defer")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        import shutil
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "modes(*names): run this test only in these modes")
    config.addinivalue_line("markers", "slow_params(*ids): the parametrizations whose id has one of "
                            "these parts are slow (kept out of the default run); "
                            "slow_params(\"strict\") on a long test: the default run "
                            "runs it in defer mode only, make test-full in both")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``slow_params``: mark the long parametrizations of a test slow before ``-m`` selects."""
    for item in items:
        slow_ids = {a for m in item.iter_markers("slow_params") for a in m.args}
        callspec = getattr(item, "callspec", None)
        if not slow_ids or callspec is None:
            continue
        if set(callspec.id.split("-")) & slow_ids:
            item.add_marker(pytest.mark.slow)


def pytest_generate_tests(metafunc):
    if "tpu_mode" in metafunc.fixturenames:
        m = metafunc.definition.get_closest_marker("modes")
        modes = m.args if m else ALL_MODES
        metafunc.parametrize("tpu_mode", modes, indirect=True)


@pytest.fixture(autouse=True, scope="module")
def _drop_programs_after_each_file():
    """Each test file starts without the compiled programs of the files before it (they come back
    from the disk cache if needed): the whole run in one process would otherwise keep ~20,000
    programs alive, near the process's cap of memory mappings (NOTE [JIT mappings]), where the
    engine's own guard would drop them in the middle of some later test."""
    yield
    import jax
    deferfuse.sync()
    deferfuse.clear_caches()
    jax.clear_caches()


@pytest.fixture(autouse=True)
def tpu_mode(request):
    name = getattr(request, "param", "strict")
    torch.manual_seed(0)
    deferfuse.reset_metrics()
    with deferfuse.mode(name):
        yield name


@pytest.fixture
def no_cpu_fallbacks():
    """The test ran every op on JAX (for test modules that mark themselves with it)."""
    deferfuse.reset_metrics()
    yield
    deferfuse.sync()
    assert dict(deferfuse.metrics()["cpu_fallbacks"]) == {}


@pytest.fixture
def group(tmp_path):
    """A tpu process group of this process alone."""
    import torch.distributed as dist
    dist.init_process_group("tpu", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
