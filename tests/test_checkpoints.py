"""Checkpoints as on CUDA (NOTE [tpu checkpoints] in deferfuse/serialization.py): ``torch.save``
records the tpu location, ``torch.load`` restores it (``weights_only=True`` by default),
``map_location`` works as for CUDA; whole models, state dicts, optimizer state, safetensors and
Hugging Face ``save_pretrained``/``from_pretrained`` round-trip. Values are compared with the same
model on CPU."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from util import assert_same


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6),
                            torch.nn.LayerNorm(6), torch.nn.Linear(6, 10))
    m[3].weight = m[0].weight                  # tied input and output embeddings
    return m


def _train(m, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    dev = next(m.parameters()).device
    for _ in range(steps):
        x = torch.randint(0, 10, (4, 5), generator=g).to(dev)
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach()


def test_tensors_come_back_on_tpu(tmp_path, tpu_mode):
    torch.manual_seed(0)
    cpu = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
           "f64": torch.randn(2, dtype=torch.float64), "i64": torch.arange(7),
           "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
           "grad": torch.randn(3).requires_grad_(), "param": torch.nn.Parameter(torch.randn(2, 2))}
    tpu = {k: (torch.nn.Parameter(v.detach().to("tpu")) if isinstance(v, torch.nn.Parameter)
               else v.detach().to("tpu").requires_grad_(v.requires_grad)) for k, v in cpu.items()}
    tpu["view"] = tpu["f32"][1:, ::2]          # a view is saved as its own values
    tpu["again"] = tpu["param"]                # one object saved twice stays one object
    path = tmp_path / "t.pt"
    torch.save(tpu, path)
    back = torch.load(path)                    # weights_only=True, torch.load's default
    for k, v in cpu.items():
        assert_same(back[k].detach(), v.detach(), msg=k)
        assert back[k].requires_grad == v.requires_grad, k
    assert isinstance(back["param"], torch.nn.Parameter)
    assert back["again"] is back["param"]
    assert_same(back["view"], cpu["f32"][1:, ::2])


@pytest.mark.parametrize("where", ["cpu", "cpu device", "dict", "callable", "tpu", "tpu device"])
def test_map_location_as_for_cuda(tmp_path, where):
    m = _model()
    ref = copy.deepcopy(m).state_dict()
    path = tmp_path / "m.pt"
    torch.save(m.to("tpu").state_dict(), path)
    loc = {"cpu": "cpu", "cpu device": torch.device("cpu"), "dict": {"tpu:0": "cpu"},
           "callable": lambda storage, location: storage, "tpu": "tpu",
           "tpu device": torch.device("tpu")}[where]
    back = torch.load(path, map_location=loc)
    want = "tpu" if where.startswith("tpu") else "cpu"
    assert list(back) == list(ref)
    for k, v in ref.items():
        assert back[k].device.type == want, (k, back[k].device)
        torch.testing.assert_close(back[k].cpu(), v)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_training_resumes_from_a_checkpoint(tmp_path, tpu_mode):
    # Train, save model and optimizer, load them in fresh objects, train on: as on CPU.
    cpu_m = _model()
    cpu_opt = torch.optim.AdamW(cpu_m.parameters(), lr=1e-2)
    m = _model().to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(cpu_m, cpu_opt, 2, seed=1)
    _train(m, opt, 2, seed=1)
    path = tmp_path / "ck.pt"
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "epoch": 2}, path)
    whole = tmp_path / "whole.pt"
    torch.save(m, whole)

    ck = torch.load(path)
    assert ck["epoch"] == 2
    assert all(s["exp_avg"].device.type == "tpu" for s in ck["opt"]["state"].values())
    m2 = _model().to("tpu")
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    m3 = torch.load(whole, weights_only=False)
    assert m3[3].weight is m3[0].weight        # still tied
    assert all(p.device.type == "tpu" and isinstance(p, torch.nn.Parameter) for p in m3.parameters())
    opt3 = torch.optim.AdamW(m3.parameters(), lr=1e-2)
    # (a second load: load_state_dict keeps the loaded tensors, which opt2 now updates in place)
    opt3.load_state_dict(torch.load(path)["opt"])

    want = _train(cpu_m, cpu_opt, 2, seed=2)
    for model, o in ((m2, opt2), (m3, opt3)):
        got = _train(model, o, 2, seed=2)
        assert_same(got, want, atol=1e-5, rtol=1e-5)
        for (n, p), q in zip(model.named_parameters(), cpu_m.parameters()):
            assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_whole_model_with_weights_only_and_safe_globals(tmp_path):
    # pytorch/examples' word_language_model: torch.load(f) of a whole model, its classes allowed.
    m = _model().to("tpu")
    path = tmp_path / "m.pt"
    torch.save(m, path)
    classes = [torch.nn.Sequential, torch.nn.Embedding, torch.nn.Linear, torch.nn.LayerNorm]
    with torch.serialization.safe_globals(classes):
        back = torch.load(path)
    x = torch.randint(0, 10, (2, 3))
    assert_same(back(x.to("tpu")), _model()(x), atol=1e-5)


def test_safetensors_roundtrip(tmp_path):
    from safetensors.torch import load_file, load_model, save_file, save_model
    m = _model()
    sd = {k: v for k, v in m.state_dict().items() if k != "3.weight"}   # safetensors: no aliases
    tpu_sd = {k: v.to("tpu") for k, v in sd.items()}
    save_file(tpu_sd, tmp_path / "w.safetensors")
    back = load_file(tmp_path / "w.safetensors")           # safetensors loads on CPU
    for k, v in sd.items():
        torch.testing.assert_close(back[k], v)
    # A model with tied weights (save_model drops the alias), loaded into a tpu model.
    save_model(m.to("tpu"), str(tmp_path / "m.safetensors"))
    fresh = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6),
                                torch.nn.LayerNorm(6), torch.nn.Linear(6, 10)).to("tpu")
    fresh[3].weight = fresh[0].weight
    missing, unexpected = load_model(fresh, str(tmp_path / "m.safetensors"))
    assert not unexpected
    for (n, p), q in zip(fresh.state_dict().items(), _model().state_dict().values()):
        assert_same(p, q, msg=n)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_hugging_face_save_and_load_pretrained(tmp_path, tpu_mode):
    import transformers
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval().to("tpu")
    model.save_pretrained(tmp_path / "gpt2")
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    ids = torch.randint(0, 64, (2, 8))
    want = ref(ids).logits.detach()
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval().to("tpu")
    # device_map="tpu" goes through accelerate (the hf extra), as device_map="cuda" does
    mapped = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", device_map="tpu").eval()
    for m in (back, mapped):
        assert m.lm_head.weight is m.transformer.wte.weight
        assert all(p.device.type == "tpu" for p in m.parameters())
        with torch.no_grad():
            assert_same(m(ids.to("tpu")).logits, want, atol=1e-5)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_tpu_checkpoint_where_deferfuse_is_not_loaded(tmp_path):
    # A machine without deferfuse (autoload off and no import here): map_location="cpu" works as
    # for a CUDA checkpoint on a CPU machine; without it PyTorch's own parser refuses "tpu".
    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(4.0).to("tpu")}, path)
    code = textwrap.dedent(f"""
        import sys, torch
        print(torch.load({str(path)!r}, map_location="cpu")["w"].tolist())
        try:
            torch.load({str(path)!r})
        except RuntimeError as e:
            print("refused:", "tpu" in str(e))
        assert "deferfuse" not in sys.modules
        """)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[0.0, 1.0, 2.0, 3.0]", "refused: True"]
    # With deferfuse installed, a plain `import torch` loads it back on tpu (autoload).
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD")
    code = f"import torch; w = torch.load({str(path)!r})['w']; print(w.device, w.tolist())"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tpu:0 [0.0, 1.0, 2.0, 3.0]"
