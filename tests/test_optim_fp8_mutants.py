"""engine/optim.py's and engine/fp8.py's rules that the other fast tests let through, one mutant (or a family) a
test. AdamWSR on bf16 weights, eager and through the compiled kernel (Inductor's C++ kernel here): every step is
torch.optim.AdamW's in float64 from the same bf16 weight and moments (bias corrections, betas, eps outside the
square root after the second bias correction, decoupled weight decay, the step count), the moments rounded to
nearest and the weight to one of its two bf16 neighbours, up as often as its distance from the lower one; parameters
without a gradient; fp32 weights never reaching the bf16 kernel; a kernel failing after its first chunk; the
defaults (DeepSpeed's FusedAdam's). train.fp8: torchao.float8 missing, an expert_parallel section without
`enabled`, the capability asked of device 0 without LOCAL_RANK, the gates kept by name whatever their size,
convert with fp8 off, the token-group alignment left alone where no expert converts, and an all-zero row (AutoEP's
padding) through the emulated FP8 rounding. Each expected value is torch's own AdamW, a plain formula in the test
or a literal; nothing here needs a launcher, a GPU or a model. The docstring's bracket names the mutant."""
import inspect
import sys

import pytest
import torch

import engine.optim as optim
from engine.optim import AdamWSR

# ------------------------------------------------------------------------------------------------ engine/optim.py

KW = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3)  # none of them a default; b1 != b2


def torch_adamw64(w, g, m, v, step):
    """torch.optim.AdamW's step `step` in float64 from weight w, gradient g and moments m, v (the reference)."""
    p = w.double().clone().requires_grad_()
    opt = torch.optim.AdamW([p], **KW)
    p.grad = g.double().clone()
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.double().clone(),
                    "exp_avg_sq": v.double().clone()}
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def bf16_bounds(x):
    """The bf16 values just below and just above each value of x (the same where x is one)."""
    x32 = x.float()
    t = (x32.view(torch.int32) & -(1 << 16)).view(torch.float32)  # toward zero
    away = torch.where(t == x32, t, (t.view(torch.int32) + (1 << 16)).view(torch.float32))
    return torch.minimum(t, away).double(), torch.maximum(t, away).double()


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_each_bf16_step_is_torch_adamw_in_float64_then_rounded(path, monkeypatch):
    """4 steps on 5000 bf16 weights (3 chunks, one partial), gradients from 1e-5 to 1 against eps 1e-3. Before each
    step the weight and moments are read back and torch.optim.AdamW (float64) takes the same step from them: the new
    moments must be its moments rounded to nearest (half a bf16 step, plus fp32 slack), the new weight one of the two
    bf16 values around its weight (fp32 slack), and over all elements the one farther from zero as often as the
    weight's distance in gaps from the nearer one (unbiased: the mean of away - distance within 0.02; its sd is
    < 0.004; rounding toward zero every time gives -0.5). `compiled` runs
    engine/optim.py's _sr_chunk through torch.compile. [kills: bias correction 1 or 2 dropped or with the other
    beta, beta1/beta2 swapped, the step count off by one, eps inside the square root or before the second bias
    correction, eps dropped in the kernel, weight decay without lr, with the bias-corrected lr, coupled into the
    gradient or dropped, the moments not stored, lr without bias correction in the kernel, the noise's range halved
    or the rounding truncating]"""
    monkeypatch.setattr(optim, "CHUNK", 2048)
    monkeypatch.setattr(optim, "COMPILE_ON", ("cpu",) if path == "compiled" else ())
    monkeypatch.setattr(optim, "_compiled", None)
    gen = torch.Generator().manual_seed(0)
    n = 5000
    p = (torch.randn(n, generator=gen) * 2).bfloat16().requires_grad_()
    opt = AdamWSR([p], seed=3, **KW)
    up_minus_frac = []
    for step in range(1, 5):
        g = (torch.randn(n, generator=gen) * 10.0 ** (-5 * torch.rand(n, generator=gen))).bfloat16()
        w0 = p.detach().clone()
        st = opt.state[p]
        m0, v0 = (st["exp_avg"].clone(), st["exp_avg_sq"].clone()) if st else (torch.zeros(n), torch.zeros(n))
        w_ref, m_ref, v_ref = torch_adamw64(w0, g, m0, v0, step)
        p.grad = g.clone()
        opt.step()
        assert opt.state[p]["step"] == step
        for ours, ref, slack in ((opt.state[p]["exp_avg"], m_ref, m0.double().abs() + g.double().abs()),
                                 (opt.state[p]["exp_avg_sq"], v_ref, v0.double() + g.double() ** 2)):
            assert ours.dtype == torch.bfloat16
            err = (ours.double() - ref).abs() - (2.0 ** -8 * ref.abs() + 1e-6 * slack)
            assert err.max().item() <= 0, (step, err.argmax().item())
        w = p.detach().double()
        tol = 1e-6 * (w0.double().abs() + (w_ref - w0.double()).abs()) + 1e-30
        lo, hi = bf16_bounds(w_ref - tol)[0], bf16_bounds(w_ref + tol)[1]
        outside = (w < lo) | (w > hi)
        assert not outside.any(), (step, outside.nonzero()[:5].flatten().tolist())
        lo, hi = bf16_bounds(w_ref.abs())  # in magnitude: truncating the bits rounds toward zero on both signs
        between = hi > lo
        away = (w.abs() == hi)[between].double()
        up_minus_frac.append(away - (w_ref.abs() - lo)[between] / (hi - lo)[between])
    if path == "compiled":
        assert callable(optim._compiled)  # the kernel ran
    bias = torch.cat(up_minus_frac).mean().item()
    assert abs(bias) < 0.02, bias


def test_parameters_without_a_gradient_are_left_alone():
    """A parameter whose grad is None (frozen, or unused this step) is skipped, as by torch.optim.AdamW: not moved,
    no state; the others step. [kills: the grad-None skip dropped]"""
    torch.manual_seed(0)
    p, q = torch.randn(64).bfloat16().requires_grad_(), torch.randn(64).bfloat16().requires_grad_()
    q0 = q.detach().clone()
    opt = AdamWSR([p, q], lr=0.1, seed=1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(q.detach(), q0) and q not in opt.state
    assert opt.state[p]["step"] == 1 and not torch.equal(p.detach(), q0)


def test_fp32_weights_never_reach_the_bf16_kernel(monkeypatch):
    """The compiled kernel rounds its result to bf16: fp32 weights (nothing to round) take the eager path even on a
    device where the kernel runs, and equal torch.optim.AdamW's bit for bit. [kills: a generator (and so the kernel)
    for every dtype, not only bf16]"""
    calls = []

    def kernel(*args):
        calls.append(args)
        raise AssertionError("the bf16 kernel ran on fp32 weights")

    monkeypatch.setattr(optim, "COMPILE_ON", ("cpu",))
    monkeypatch.setattr(optim, "_compiled", kernel)
    torch.manual_seed(0)
    ref = torch.randn(300, requires_grad=True)
    ours = ref.detach().clone().requires_grad_()
    a, b = torch.optim.AdamW([ref], **KW), AdamWSR([ours], **KW)
    for _ in range(2):
        ref.grad = torch.randn(300)
        ours.grad = ref.grad.clone()
        a.step()
        b.step()
    assert calls == [] and torch.equal(ref, ours)


def test_a_kernel_failure_after_the_first_chunk_is_raised(monkeypatch):
    """Only a failure at the first chunk (a compile error, before anything is written) falls back to the eager
    update; once a chunk is written, falling back would update it twice, so a later failure is raised.
    [kills: the fallback taken at any chunk (`if i or ...` dropped)]"""
    def kernel(w, g, m, v, noise, s):
        if kernel.calls:
            raise RuntimeError("chunk 2")
        kernel.calls += 1
        w.add_(1.0)  # chunk 1 written

    kernel.calls = 0
    monkeypatch.setattr(optim, "CHUNK", 1000)
    monkeypatch.setattr(optim, "COMPILE_ON", ("cpu",))
    monkeypatch.setattr(optim, "_compiled", kernel)
    p = torch.zeros(2500, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="chunk 2"):
        AdamWSR([p], lr=1e-3).step()


def test_the_defaults_are_deepspeed_fused_adams():
    """What the DS config leaves out of lr, betas, eps and weight_decay takes DeepSpeed's FusedAdam's default (the
    optimizer AdamWSR replaces; engine/parallel.py passes only the params the config has): 1e-3, (0.9, 0.999), 1e-8,
    0. [kills: any of the four defaults changed]"""
    from deepspeed.ops.adam import FusedAdam

    fused = inspect.signature(FusedAdam.__init__).parameters
    ours = AdamWSR([torch.zeros(1, requires_grad=True)]).defaults
    assert ours == {k: fused[k].default for k in ("lr", "betas", "eps", "weight_decay")} == \
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, ours


# -------------------------------------------------------------------------------------------------- engine/fp8.py

pytest.importorskip("torchao.float8", reason='train.fp8 needs torchao: pip install -e ".[fp8]"')
INSTALL = 'train.fp8: needs torchao, which is not installed: pip install -e ".[fp8]"'


def ds(name):
    from conftest import ROOT
    from engine.ds_config import read_ds_config

    return read_ds_config(ROOT / "ds_configs" / name)


def test_dense_and_all_are_refused_without_torchao_float8(monkeypatch):
    """Without torchao.float8 (the Float8Linear of both modes) dense and all are refused with the install line.
    [kills: the torchao.float8 import dropped from the check]"""
    from engine.fp8 import fp8_problems

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # its import raises ImportError
    for mode in ("dense", "all"):
        assert fp8_problems(mode, ds("zero3.json"), "cpu") == [INSTALL], mode


def test_all_refuses_an_expert_parallel_section_without_enabled():
    """DeepSpeed reads a missing expert_parallel.enabled as false (AutoEP off), so fp8 all refuses such a section
    in one line. [kills: a missing `enabled` taken as true; the one-line refusal becoming two when comm_backend is
    also not comm (`elif` to `if`)]"""
    from engine.fp8 import fp8_problems

    raw = ds("zero3.json")
    del raw["expert_parallel"]["enabled"]
    p = fp8_problems("all", raw, "cpu")
    assert len(p) == 1 and "no enabled expert_parallel section" in p[0], p
    raw["expert_parallel"]["comm_backend"] = "deepep"
    p = fp8_problems("all", raw, "cpu")
    assert len(p) == 1 and "no enabled expert_parallel section" in p[0], p


def test_the_capability_is_asked_of_device_0_without_local_rank(monkeypatch):
    """A single-process run has no LOCAL_RANK: the capability asked is device 0's. [kills: another default rank]"""
    from engine.fp8 import fp8_problems

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or (9, 0))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert fp8_problems("dense", ds("zero3.json"), "cuda") == [] and asked == [0]


@pytest.mark.parametrize("device", ["rocm", "xpu"])
def test_fp8_on_a_device_without_its_gemms_is_refused_not_emulated(device):
    """On a device other than CUDA and the CPU (ROCm, XPU) torchao would emulate the FP8 GEMMs: a bf16 run made
    slower, with no FP8 in it. Refused in one line there; the CPU (the tests' emulation) is not. [fails if: another
    device passes the check silently, or the CPU is refused]"""
    from engine.fp8 import fp8_problems

    assert fp8_problems("dense", ds("zero3.json"), device) == [
        f"train.fp8: its FP8 GEMMs run on NVIDIA GPUs (compute capability 8.9+) only; on {device} they would be "
        "emulated, slower than bf16; set train.fp8: false"]
    assert fp8_problems("dense", ds("zero3.json"), "cpu") == []


def test_gates_stay_out_of_fp8_by_name_whatever_their_size():
    """The shared-expert gate and Gated DeltaNet's beta and decay gates are kept by name, not only because their
    usual widths (1 output, one per head) are not multiples of 16: 32 x 32 ones stay too; 32 x 32 projections of
    other names convert. [kills: shared_expert_gate, in_proj_a or in_proj_b dropped from the names]"""
    from engine.fp8 import convertible

    lin = torch.nn.Linear(32, 32)
    for leaf in ("shared_expert_gate", "in_proj_a", "in_proj_b"):
        assert not convertible(f"model.layers.0.mlp.{leaf}", lin), leaf
    for leaf in ("in_proj_qkv", "in_proj_z", "shared_expert.gate_proj"):
        assert convertible(f"model.layers.0.linear_attn.{leaf}", lin), leaf


def test_convert_with_fp8_off_converts_nothing():
    """convert(model, False, ...) returns [] and leaves every linear a torch Linear. [kills: the `mode is False`
    early return dropped]"""
    from engine.fp8 import convert

    m = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(32, 32)})
    assert convert(m, False, "cpu") == []
    assert type(m["q_proj"]) is torch.nn.Linear


def test_the_token_group_alignment_is_left_alone_where_no_expert_converts(monkeypatch):
    """The alignment is raised to 16 for the FP8 grouped GEMM only; where no expert converts (odd sizes) AutoEP
    keeps its own (8). [kills: the alignment raised whatever converted]"""
    from deepspeed.moe import ep_kernels
    from deepspeed.moe.ep_experts import GroupedExperts

    from engine.fp8 import convert_experts

    monkeypatch.setattr(ep_kernels, "TOKEN_GROUP_ALIGN_SIZE_M", 8)
    assert convert_experts(torch.nn.ModuleDict({"odd": GroupedExperts(32, 24, 2)}), "cpu") == []
    assert ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M == 8


def test_an_all_zero_row_goes_through_fp8_as_zeros():
    """AutoEP pads each expert's token group with zero rows: a row whose amax is 0 gets the floor's scale, not an
    infinite one, so it comes out 0 (not NaN), forward and backward, and the other rows are untouched.
    [kills: the amax floor (clamp(min=1e-12)) dropped]"""
    from engine.fp8 import _fp8_round, emulated_grouped_mm

    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25]])
    assert torch.equal(_fp8_round(x, -1), x)  # e4m3 values: exact
    a = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)  # expert 0: one row and one padding row
    b_t = torch.tensor([[[1.0, 0.5], [0.25, -1.0]]], requires_grad=True)
    out = emulated_grouped_mm(a, b_t, torch.tensor([2], dtype=torch.int32), torch.float32)
    assert out.tolist() == [[1.5, -1.5], [0.0, 0.0]]
    out.backward(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert a.grad.tolist() == [[1.0, 0.25], [0.0, 0.0]]
    assert b_t.grad.tolist() == [[[1.0, 0.0], [2.0, 0.0]]]
