"""train.fp8 (engine/fp8.py) on CPU ranks, where torchao emulates the dense FP8 GEMMs with the same quantization and
engine/fp8.py emulates the routed experts' FP8 grouped GEMM: which layers convert, that FP8 changes the numerics by
its rounding and no more, 2 ranks (ZeRO-3 + EP 2) against 1, a resume without FP8, the export, and the refusals. On
a CUDA machine also torchao's real FP8 grouped GEMM against the emulation."""
import json

import numpy as np
import pytest
import torch

from conftest import ROOT, read_metrics, run_in_process, run_ranks, write_ds

pytest.importorskip("torchao.float8", reason='train.fp8 needs torchao: pip install -e ".[fp8]"')

PROBE = ROOT / "tests" / "scripts" / "probe.py"
PRETRAIN = ROOT / "bin" / "pretrain.py"
RECIPE = """
model: {arch: deepseek_v3, hidden_size: 128, num_layers: 2, num_heads: 4, intermediate_size: 256,
        moe_intermediate_size: 128, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 512, first_dense_layers: 1}
data: {seq_len: 32, path: DATA}
train: {max_steps: 4, warmup_steps: 1, log_every: 1, fp8: FP8}
checkpoint: {every_steps: 2}
"""


def fp32_ds(path, micro: int, accum: int, leaf: bool = True):
    """zero3.json in fp32 (2 ranks vs 1 then differ by summation order only), no persistence threshold; leaf False:
    without its leaf_module (DeepSpeed's hooks on every module)."""
    ds = write_ds(path, drop=("bf16",), train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
    cfg = json.loads(ds.read_text())
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if not leaf:
        del cfg["zero_optimization"]["leaf_module"]
    ds.write_text(json.dumps(cfg))
    return ds


def test_dense_converts_attention_shared_experts_and_dense_mlps_only():
    from engine.config import load_recipe
    from engine.fp8 import convert
    from engine.model import make_hf_config
    from transformers import AutoModelForCausalLM

    for arch in ("deepseek_v3", "qwen3_moe", "mixtral", "qwen3_5_moe"):
        over = {"model.arch": arch, "model.hidden_size": 128, "model.intermediate_size": 256,
                "model.moe_intermediate_size": 128, "model.first_dense_layers": 1 if arch == "deepseek_v3" else 0,
                "train.balance_rate": 0.0}
        if arch == "qwen3_5_moe":  # 16 heads: the DeltaNet gates' 16 outputs are FP8-sized, and stay in bf16/fp32
            over.update({"model.num_heads": 16, "model.num_kv_heads": 16, "model.hidden_size": 256,
                         "model.num_layers": 4})  # the 4th layer is full attention
        m = load_recipe(None, over).model
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_hf_config(m))
        x = torch.randint(0, m.vocab_size, (2, 16))
        with torch.no_grad():
            before = model(x).logits
        names = convert(model, "dense", "cpu")
        kinds = {type(mod).__name__ for n, mod in model.named_modules() if n in names}
        assert kinds == {"Float8Linear"}, (arch, kinds)
        assert names and all(any(k in n for k in (".self_attn.", ".linear_attn.", ".shared_expert", ".mlp."))
                             for n in names), names
        assert not any(n == "lm_head" or n.endswith((".gate", ".shared_expert_gate", ".in_proj_a", ".in_proj_b"))
                       or ".experts." in n for n in names), names
        if arch == "qwen3_5_moe":  # its DeltaNet projections but the gates
            assert "model.layers.0.linear_attn.in_proj_qkv" in names, names
        assert type(model.lm_head) is torch.nn.Linear
        if arch == "deepseek_v3":  # the dense first layer's MLP and the MoE layer's shared experts
            assert "model.layers.0.mlp.gate_proj" in names and "model.layers.1.mlp.shared_experts.down_proj" in names
        with torch.no_grad():
            after = model(x).logits
        # FP8 (e4m3: 3 mantissa bits) changes the logits, by about its rounding, no more
        diff = (after - before).abs().max().item()
        assert 1e-4 < diff, (arch, diff)
        if arch != "qwen3_5_moe":  # at this init one FP8 matmul of its layer 0 (out_proj alone) moves its logits by
            assert diff < 0.2 * before.abs().max().item(), (arch, diff)  # 22% RMS, one of layer 3 by < 6%: it grows


def grouped_case(dtype=torch.float32, device="cpu", seed=0):
    """Rows for 5 experts in aligned groups of 16, 0, 32, 16 and 16 rows, weights (E, K, N) column-major as AutoEP
    passes them, and an output gradient, with x2^20 outliers along each scale axis, one GEMM's worth per group: a
    row of the input (group 0: the forward's row scales), a weight column (expert 2: the forward's column scales), a
    row of the output gradient and of the weight (group 3: the input gradient's), a column of the input and of the
    output gradient (group 4: the weight gradient's per-group column scales). FP8's range (2^-9 to 448 of a scale)
    flushes the rest of a slice that shares its scale with an outlier; with the right axes none does."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(80, 32, generator=g)
    b_t = torch.randn(5, 48, 32, generator=g).transpose(-2, -1)  # (E, K=32, N=48), strides (K*N, 1, K)
    grad_out = torch.randn(80, 48, generator=g)
    big = 2.0 ** 20
    a[5] *= big
    b_t[2, :, 7] *= big
    grad_out[60] *= big
    b_t[3, 9, :] *= big
    a[64:, 3] *= big
    grad_out[64:, 11] *= big
    offs = torch.tensor([16, 16, 48, 64, 80], dtype=torch.int32, device=device)
    return (a.to(device, dtype).requires_grad_(), b_t.to(device, dtype).detach().requires_grad_(), offs,
            grad_out.to(device, dtype))


def grouped_reference(a, b_t, offs, grad_out):
    """The exact grouped GEMM (fp64), forward and both gradients, and the same of the operands' absolute values:
    the scale FP8's error is relative to (a sum of products rounded per operand, not its possibly cancelled result)."""
    res = []
    for f in (lambda t: t, torch.abs):
        x, w = f(a.detach()).double().requires_grad_(), f(b_t.detach()).double().requires_grad_()
        out = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
        out.backward(f(grad_out).double())
        res.append((out.detach(), x.grad, w.grad))
    return res


def rel_err(x, ref, mag):
    """Largest error relative to the sum of the absolute products that made the element."""
    return ((x.double() - ref).abs() / mag.clamp(min=1e-30)).max().item()


def fp8_grouped_results(mm, a, b_t, offs, grad_out):
    out = mm(a, b_t, offs, a.dtype)
    out.backward(grad_out)
    return out.detach(), a.grad, b_t.grad


def test_emulated_fp8_grouped_gemm_rounds_like_fp8_with_row_and_column_scales():
    from engine.fp8 import emulated_grouped_mm

    a, b_t, offs, grad_out = grouped_case()
    got = fp8_grouped_results(emulated_grouped_mm, a, b_t, offs, grad_out)
    ref, mag = grouped_reference(a, b_t, offs, grad_out)
    # e4m3 keeps 3 mantissa bits (relative rounding <= 1/16 per operand): each element within 1/8 of the absolute
    # products it sums despite the outliers, and FP8 is really on (fp32 would agree to ~1e-7)
    for x, r, m in zip(got, ref, mag):
        assert 1e-3 < rel_err(x, r, m) < 0.125, rel_err(x, r, m)
    assert torch.equal(got[2][1], torch.zeros_like(got[2][1]))  # expert 1 got no rows


def test_all_converts_the_routed_experts_of_autoep_only():
    """convert_experts swaps AutoEP's GroupedExperts forward for the FP8 one (both dimensions multiples of 16 only)
    and raises DeepSpeed's token-group alignment to 16; the weights stay the module's parameters."""
    from deepspeed.moe import ep_kernels
    from deepspeed.moe.ep_experts import GroupedExperts, _run_experts_for_loop

    from engine.fp8 import convert_experts

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"ok": GroupedExperts(32, 48, 5), "odd": GroupedExperts(24, 48, 5),
                                 "lin": torch.nn.Linear(32, 32)})
    for prm in model.parameters():
        torch.nn.init.normal_(prm, std=0.1)
    offs = grouped_case()[2]
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    x = torch.randn(int(offs[-1]), 32)
    ok = model["ok"]
    before = _run_experts_for_loop(ok.w1, ok.w2, ok.w3, x, counts)  # bf16 GroupedExperts' math, plain PyTorch
    params = [id(prm) for prm in model.parameters()]
    align = ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        assert convert_experts(model, "cpu") == ["ok"]
        assert ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M == 16
    finally:
        ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M = align
    assert [id(prm) for prm in model.parameters()] == params
    assert type(model["odd"]).forward is model["odd"].forward.__func__
    after = model["ok"](x, counts)
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert 1e-3 < rel < 0.1, rel


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="torchao's FP8 grouped GEMM needs a CUDA GPU with FP8 tensor cores")
def test_torchao_fp8_grouped_gemm_is_the_emulation_on_a_gpu():
    """On the GPU train.fp8 all runs torchao's kernels; the CPU tests run engine/fp8.py's emulation. Both quantize to
    the same e4m3 values with the same scales, so they differ by accumulation order and bf16 output rounding only:
    well below either's distance from the exact product."""
    from engine.fp8 import emulated_grouped_mm, fp8_grouped_mm

    res = {}
    for name, mm, device in (("gpu", fp8_grouped_mm, "cuda"), ("emu", emulated_grouped_mm, "cpu")):
        a, b_t, offs, grad_out = grouped_case(torch.bfloat16, device)
        res[name] = [t.cpu() for t in fp8_grouped_results(mm, a, b_t, offs, grad_out)]
    ref, mag = grouped_reference(*grouped_case(torch.bfloat16))
    for i in range(3):
        gap, fp8_err = rel_err(res["gpu"][i], res["emu"][i].double(), mag[i]), rel_err(res["emu"][i], ref[i], mag[i])
        assert gap < 0.25 * fp8_err, (i, gap, fp8_err)


def alike_windows(path, seq_len: int = 32):
    """A corpus whose packed windows are all the same sequence: 64 copies of a document of seq_len - 1 tokens (+ EOS).
    FP8's scales are taken over what one GEMM sees (a micro-batch's tensor, the rows an expert received from every
    rank of its group), so 1 rank and 2 quantize alike only where their batches hold alike data."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "engine" / "assets" / "tokenizer")
    text = json.loads((ROOT / "engine" / "assets" / "corpus.jsonl").open().readline())["text"]
    doc = tok.decode(tok(text)["input_ids"][:seq_len - 1])
    assert len(tok(doc)["input_ids"]) == seq_len - 1
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for _ in range(64)))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FP8 all (dense linears and routed experts), fp32 masters: 1 rank x micro 2 and 2 ranks (ZeRO-3, expert
    parallel 2) x micro 1, the same global batch, every window alike (alike_windows): each dense GEMM quantizes a
    tensor alike on both, and each expert's grouped GEMM gets the same rows (on 2 ranks from both). And the same
    1-rank run without FP8. "one" and "two" hook every module (zero3.json without its leaf_module), "two_leaf" is
    zero3.json's leaves: see test_two_ranks_train_in_fp8_as_one."""
    tmp = tmp_path_factory.mktemp("fp8")
    data = alike_windows(tmp / "alike.jsonl")
    out = {}
    for name, ranks, micro, fp8, leaf in (("one", 1, 2, "all", False), ("two", 2, 1, "all", False),
                                          ("two_leaf", 2, 1, "all", True), ("bf", 1, 2, "false", True)):
        d = tmp / name
        d.mkdir()
        (d / "recipe.yaml").write_text(RECIPE.replace("FP8", fp8).replace("DATA", str(data)))
        run_ranks(ranks, PROBE, "--out", d / "out", "--deepspeed_config", fp32_ds(d / "ds.json", micro, 1, leaf),
                  "--config", d / "recipe.yaml", "--run_dir", d / "run", cwd=d)
        out[name] = json.loads((d / "out" / "rank0.json").read_text())
    out["tmp"], out["data"] = tmp, data
    return out


def test_two_ranks_train_in_fp8_as_one(runs):
    """Over 4 steps FP8 turns an fp32 rounding difference into a loss difference of up to ~1e-4 (a value crosses an
    e4m3 rounding boundary, and the next steps amplify it), so 1 rank and 2 are compared where they sum each
    gradient in the same order: with a hook on every module (with zero3.json's decoder-layer leaves, 1 rank's autograd
    sums some of a layer's input-gradient contributions in another order: 3.7e-6 apart at step 3, 1e-4 at step 4,
    measured). The leaves themselves are checked on 2 ranks: the same losses as a hook per module."""
    one, two, bf = runs["one"]["losses"], runs["two"]["losses"], runs["bf"]["losses"]
    assert len(one) == 4
    assert np.allclose(one, two, rtol=1e-5), (one, two)  # fp32 summation order only
    assert np.allclose(two, runs["two_leaf"]["losses"], rtol=1e-5), (two, runs["two_leaf"]["losses"])
    # ... and FP8 is on: the same run without it differs by more than that
    assert max(abs(a - b) / abs(b) for a, b in zip(one, bf)) > 1e-4, (one, bf)


def test_an_fp8_checkpoint_resumes_without_fp8_and_exports_the_engines_model(runs, capfd, monkeypatch):
    tmp = runs["tmp"]
    d = tmp / "one"
    # resume the FP8 run's step-2 checkpoint with fp8 off: it loads and trains steps 3-4
    (d / "plain.yaml").write_text(RECIPE.replace("FP8", "false").replace("DATA", str(runs["data"])))
    run = tmp / "resumed"
    import shutil

    shutil.copytree(d / "run", run)
    ck = run / "checkpoints"
    shutil.rmtree(ck / "step_00000004")
    (ck / "latest").write_text("step_00000002")
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in (run / "metrics.jsonl").read_text().splitlines()[:2]))
    run_ranks(1, PRETRAIN, "--deepspeed_config", fp32_ds(tmp / "resume_ds.json", 2, 1), "--config", d / "plain.yaml",
              "--run_dir", run, "--resume", cwd=tmp)
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    straight = runs["one"]["losses"]
    # steps 3-4 without FP8 from the FP8 weights: within FP8's effect of the FP8 run's steps
    assert all(abs(r["loss"] - s) < 0.02 * s for r, s in zip(rows[2:], straight[2:])), (rows, straight)
    # the export of the FP8 run: the keys and dtypes of the run without FP8, no FP8 leftovers
    from safetensors.torch import load_file

    from engine.export.write import main as export_main

    for name in ("one", "bf"):
        p = run_in_process(export_main, [str(tmp / name / "run"), str(tmp / f"hf_{name}")], capfd, monkeypatch)
        assert p.returncode == 0, p.stderr
    fp8_sd, bf_sd = ({k: v for f in sorted((tmp / f"hf_{n}").glob("*.safetensors")) for k, v in load_file(f).items()}
                     for n in ("one", "bf"))
    assert fp8_sd.keys() == bf_sd.keys()
    assert {k: v.dtype for k, v in fp8_sd.items()} == {k: v.dtype for k, v in bf_sd.items()}
    assert not any("float8" in str(v.dtype) for v in fp8_sd.values())
    # ... and its logits are the engine's without FP8 on the same (last) checkpoint: the FP8 run resumed with fp8 off
    # and no step left to train, then fed fixed ids (tests/scripts/pretrain_logits.py)
    from conftest import PRETRAIN_LOGITS, fixed_ids
    from transformers import AutoModelForCausalLM

    shutil.copytree(d / "run", tmp / "again")
    torch.save(fixed_ids(), tmp / "ids.pt")
    run_ranks(1, PRETRAIN_LOGITS, "--ids", tmp / "ids.pt", "--logits", tmp / "logits.pt", "--deepspeed_config",
              fp32_ds(tmp / "again_ds.json", 2, 1), "--config", d / "plain.yaml", "--run_dir", tmp / "again",
              "--resume", cwd=tmp)
    assert [r["step"] for r in read_metrics(tmp / "again") if "loss" in r] == [1, 2, 3, 4]  # nothing trained again
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf_one", dtype=torch.float32).eval()
    with torch.no_grad():
        exported = model(input_ids=fixed_ids()).logits
    engine = torch.load(tmp / "logits.pt")
    assert exported.shape == engine.shape
    assert (exported - engine).abs().max().item() <= 1e-5


@pytest.mark.parametrize("fp8, ds_change, expect", [
    ("all", {"expert_parallel": None}, "train.fp8: all runs the routed experts through AutoEP's grouped GEMM, and "
     "this DS config has no enabled expert_parallel section"),
    ("all", {"expert_parallel": {"enabled": True, "autoep_size": "auto", "comm_backend": "deepep"}},
     'train.fp8: all needs expert_parallel.comm_backend "comm"'),
    ("dense", "pipe.json", "train.fp8: not supported with a pipeline section"),
])
def test_fp8_refusals_are_one_line(fp8, ds_change, expect, tmp_path, capfd, monkeypatch):
    from engine.pretrain import main

    if isinstance(ds_change, str):
        ds = ROOT / "ds_configs" / ds_change
    else:
        ds = write_ds(tmp_path / "ds.json", drop=[k for k, v in ds_change.items() if v is None],
                      **{k: v for k, v in ds_change.items() if v is not None})
    (tmp_path / "r.yaml").write_text(f"train: {{fp8: {fp8}}}\n")
    p = run_in_process(main, ["--deepspeed_config", str(ds), "--config", str(tmp_path / "r.yaml"), "--run_dir",
                              str(tmp_path / "run")], capfd, monkeypatch)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and expect in lines[0], p.stderr


def test_grpo_refuses_fp8_in_one_line(tmp_path, capfd, monkeypatch):
    import yaml

    from engine.grpo import main

    monkeypatch.chdir(ROOT)  # grpo_tiny.yaml's paths
    recipe = yaml.safe_load((ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text())
    recipe.setdefault("train", {})["fp8"] = "dense"
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(recipe))
    p = run_in_process(main, ["--deepspeed_config", str(ROOT / "ds_configs" / "zero3_grpo.json"), "--config",
                              str(tmp_path / "g.yaml")], capfd, monkeypatch)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "train.fp8 (dense): bin/pretrain.py only so far" in lines[0], lines[0]


def test_zero3_compiled_fp8_matmul_is_float8_linears_math(monkeypatch):
    """Under ZeRO-3 on CUDA the Float8Linear matmul runs compiled (engine/model.py compile_parameter_free): the
    wrapper around it gives exactly the loss and gradients of torchao's own Float8Linear.forward (emulated here; the
    compile itself, 11 s of inductor on a CPU, is left to the GPU runs, docs/bench/fp8_gpu.sh)."""
    import copy

    from engine.config import load_recipe
    from engine.fp8 import convert
    from engine.model import compile_parameter_free, make_hf_config
    from transformers import AutoModelForCausalLM

    m = load_recipe(None, {"model.hidden_size": 64, "model.intermediate_size": 128, "model.moe_intermediate_size": 32,
                           "model.num_layers": 2, "model.first_dense_layers": 1}).model
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(make_hf_config(m))
    convert(ref, "dense", "cpu")
    patched = copy.deepcopy(ref)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the same function, eagerly
    hf_module = __import__("sys").modules[type(patched).__module__]
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):  # patched module-wide: restored after
        if hasattr(hf_module, name):
            monkeypatch.setattr(hf_module, name, getattr(hf_module, name))
    done = compile_parameter_free(patched)
    assert "Float8Linear (fp8 casts and GEMM)" in done
    assert all(type(mod).forward is not mod.forward for mod in patched.modules() if type(mod).__name__ == "Float8Linear")
    x = torch.randint(0, m.vocab_size, (2, 16))
    outs = []
    for model in (ref, patched):
        loss = model(x, labels=x).loss
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = outs
    assert g0.keys() == g1.keys() and len(g0) > 10
    assert torch.equal(l0, l1), (l0, l1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
