"""train.stochastic_rounding (engine/optim.py AdamWSR): plain AdamW on fp32 weights, unbiased rounding of bf16 weights,
updates that round-to-nearest drops, and through bin/pretrain.py with ds_configs/zero2_bf16_states.json: the bf16 run
follows the fp32-master-weights run where DeepSpeed's own optimizer falls behind, and it resumes exactly."""
import json
import shutil

import pytest
import torch

import engine.optim as optim
from conftest import ROOT, read_metrics, run_in_process, run_ranks, write_ds
from engine.optim import AdamWSR, stochastic_round_

PRETRAIN = ROOT / "bin" / "pretrain.py"


def test_fp32_weights_take_torch_adamw_steps_exactly(monkeypatch):
    """On fp32 weights nothing is rounded: every step equals torch.optim.AdamW's, across chunk boundaries."""
    monkeypatch.setattr(optim, "CHUNK", 1000)  # several chunks per tensor, one partial
    torch.manual_seed(0)
    shapes = [(37, 91), (5,), (2048,)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a, b = torch.optim.AdamW(ref, **kw), AdamWSR(ours, **kw)
    for _ in range(4):
        for p, q in zip(ref, ours):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ref, ours):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def test_rounding_picks_a_neighbour_with_the_right_odds():
    """Each value lands on one of its two bf16 neighbours, the upper one as often as its distance from the lower
    one in gaps; the mean is the fp32 value (negative values alike); exact bf16 values stay."""
    gap = 2.0 ** -7  # bf16's step in [1, 2)
    for frac in (0.1, 0.25, 0.5, 0.9):
        for sign in (1.0, -1.0):
            x = torch.full((400_000,), sign * (1.0 + frac * gap))
            out = torch.empty(x.shape, dtype=torch.bfloat16)
            stochastic_round_(out, x.clone(), torch.Generator().manual_seed(7))
            v = out.float()
            assert set(v.abs().unique().tolist()) <= {1.0, 1.0 + gap}
            up = (v.abs() > 1.0).float().mean().item()
            assert abs(up - frac) < 0.005, (frac, up)  # binomial sd <= 0.0008
    exact = torch.tensor([1.0, -3.5, 0.0, 2.0 ** -20], dtype=torch.float32)
    out = torch.empty(4, dtype=torch.bfloat16)
    stochastic_round_(out, exact.clone(), torch.Generator().manual_seed(0))
    assert torch.equal(out.float(), exact)


def test_updates_below_half_a_bf16_step_land_on_average():
    """Weights near 0.5 (bf16 step 2^-9) with lr 1e-4: torch's AdamW on bf16 weights rounds every update away;
    AdamWSR moves them as fp32 AdamW does, on average."""
    torch.manual_seed(0)
    w0 = 0.5 + 0.01 * torch.rand(200_000)
    moved = {}
    for kind in ("fp32", "nearest", "stochastic"):
        p = (w0.clone() if kind == "fp32" else w0.bfloat16()).requires_grad_()
        start = p.detach().float().clone()
        opt = (AdamWSR if kind == "stochastic" else torch.optim.AdamW)([p], lr=1e-4, weight_decay=0.0)
        for _ in range(30):
            p.grad = torch.ones_like(p)
            opt.step()
        moved[kind] = (p.detach().float() - start).mean().item()
    assert moved["fp32"] == pytest.approx(-3e-3, rel=1e-3)
    assert abs(moved["nearest"]) < 1e-4 * 3e-3 / 1e-3  # < a tenth of fp32's move
    assert moved["stochastic"] == pytest.approx(moved["fp32"], rel=0.01)


def test_a_restored_optimizer_draws_the_same_rounding(monkeypatch):
    """The noise depends on (seed, rank, step, parameter) only: an optimizer rebuilt from a state dict mid-way ends
    where the uninterrupted one does, bit for bit; another seed does not."""
    monkeypatch.setattr(optim, "CHUNK", 1 << 12)
    torch.manual_seed(1)
    w0 = torch.randn(10_000).bfloat16()
    grads = [torch.randn(10_000) for _ in range(6)]

    def run(seed, restart_at=None):
        p = w0.clone().requires_grad_()
        opt = AdamWSR([p], lr=1e-3, seed=seed)
        for i, g in enumerate(grads):
            if i == restart_at:
                state = opt.state_dict()
                opt = AdamWSR([p], lr=1e-3, seed=seed)
                opt.load_state_dict(state)
            p.grad = g.bfloat16()
            opt.step()
        return p.detach()

    whole = run(3)
    assert torch.equal(run(3, restart_at=3), whole)
    assert not torch.equal(run(4), whole)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def steps_of(device, n=40_000, steps=3):
    """AdamWSR's weights and moments after `steps` steps on bf16 weights (3 chunks, one partial)."""
    gen = torch.Generator().manual_seed(0)
    p = (0.02 * torch.randn(n, generator=gen)).bfloat16().to(device).requires_grad_()
    opt = AdamWSR([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, seed=5)
    for _ in range(steps):
        p.grad = (1e-3 * torch.randn(n, generator=gen)).bfloat16().to(device)
        opt.step()
    return p.detach().cpu(), {k: v.cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)}


@pytest.mark.parametrize("device", DEVICES)
def test_the_compiled_update_is_the_eager_one(device, monkeypatch):
    """The compiled kernel (engine/optim.py _sr_chunk, taken on CUDA; Inductor's C++ kernel on the CPU here) does the
    eager step's arithmetic and draws the same noise. An fp32 intermediate may round differently (fused multiply-adds;
    lerp near zero), so a bf16 value may differ by one bf16 step: in under 0.1% of the elements, measured 0-0.025%."""
    monkeypatch.setattr(optim, "CHUNK", 1 << 14)
    monkeypatch.setattr(optim, "COMPILE_ON", ())
    w_eager, s_eager = steps_of(device)
    monkeypatch.setattr(optim, "COMPILE_ON", (device,))
    monkeypatch.setattr(optim, "_compiled", None)
    w_comp, s_comp = steps_of(device)
    assert callable(optim._compiled)  # the compiled path ran
    moved = (w_comp != steps_of(device, steps=0)[0]).float().mean().item()
    assert moved > 0.3, moved  # the steps changed the weights (lr 1e-4 against bf16 steps of ~1e-4 at |w| 0.02)
    for a, b in [(w_eager, w_comp)] + [(s_eager[k], s_comp[k]) for k in ("exp_avg", "exp_avg_sq")]:
        differ = a != b
        assert differ.float().mean().item() < 1e-3
        a, b = a[differ].float(), b[differ].float()
        assert torch.all((a - b).abs() <= 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-10)  # one bf16 step


def test_a_failed_compile_falls_back_to_the_eager_update(monkeypatch, capsys):
    """If the kernel cannot be compiled, the step runs eagerly with the noise the eager path draws (one warning):
    the result is the eager run's."""
    monkeypatch.setattr(optim, "CHUNK", 1 << 14)
    monkeypatch.setattr(optim, "COMPILE_ON", ())
    w_eager, _ = steps_of("cpu")

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(optim, "COMPILE_ON", ("cpu",))
    monkeypatch.setattr(optim, "_compiled", broken)
    w, _ = steps_of("cpu")
    assert torch.equal(w, w_eager) and optim._compiled is False
    assert capsys.readouterr().out.count("the compiled update failed (RuntimeError: no compiler here)") == 1


RECIPE = """
model: {arch: deepseek_v3, hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128,
        moe_intermediate_size: 64, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 512}
data: {seq_len: 64}
train: {lr: 3.0e-5, warmup_steps: 1, max_steps: STEPS, decay_steps: 12, log_every: 1, stochastic_rounding: SR}
checkpoint: {every_steps: 6}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 rank, the same init and batches, lr 3e-5 (below half a bf16 step for most of the init's weights): zero2.json
    (fp32 master weights), zero2_bf16_states.json with DeepSpeed's optimizer (nearest) and with AdamWSR (auto), 12
    steps; and the auto run stopped at step 6 and resumed to 12."""
    tmp = tmp_path_factory.mktemp("optim")
    bf16 = ROOT / "ds_configs" / "zero2_bf16_states.json"
    out = {}
    for name, ds, sr, steps in (("fp32", ROOT / "ds_configs" / "zero2.json", "auto", 12), ("nearest", bf16, "false", 12),
                                ("stochastic", bf16, "auto", 12), ("resumed", bf16, "auto", 6)):
        (tmp / f"{name}.yaml").write_text(RECIPE.replace("STEPS", str(steps)).replace("SR", sr))
        p = run_ranks(1, PRETRAIN, "--deepspeed_config", ds, "--config", tmp / f"{name}.yaml", "--run_dir",
                      tmp / name, cwd=tmp)
        out[name] = (tmp / name, p.stdout)
    p = run_ranks(1, PRETRAIN, "--deepspeed_config", bf16, "--config", tmp / "stochastic.yaml", "--run_dir",
                  tmp / "resumed", "--resume", cwd=tmp)
    out["resumed"] = (tmp / "resumed", out["resumed"][1] + p.stdout)
    return out


def losses(run) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run[0]) if "loss" in r}


def test_bf16_master_weights_with_stochastic_rounding_train_like_fp32_ones(runs):
    """At an LR below half a bf16 step DeepSpeed's bf16 optimizer (round to nearest) falls behind the fp32-master run,
    and AdamWSR follows it: each step's loss against fp32's on the same batch, steps 7-12. The auto run says which
    optimizer it took; the others do not."""
    fp32, nearest, sr = (losses(runs[k]) for k in ("fp32", "nearest", "stochastic"))
    assert "stochastic rounding" in runs["stochastic"][1] and "stochastic rounding" not in runs["nearest"][1]
    assert "stochastic rounding" not in runs["fp32"][1]  # fp32 master weights: nothing to round, auto stays off
    steps = range(7, 13)  # the same batch at each step in all three runs: the gap is the optimizer's
    behind = sum(nearest[s] - fp32[s] for s in steps) / len(steps)
    sr_gap = sum(sr[s] - fp32[s] for s in steps) / len(steps)
    assert behind > 0.01, (nearest, fp32)  # measured 0.020 (0.014-0.026 per step)
    assert abs(sr_gap) < 0.25 * behind, (sr, fp32)  # measured 0.001


def test_a_stochastically_rounded_run_resumes_exactly(runs):
    """Stopped at step 6 and resumed: the same losses at steps 7-12 and the same final weights as the uninterrupted
    run (the rounding noise is seeded by the step, not drawn from a stream the checkpoint would have to carry)."""
    whole, resumed = losses(runs["stochastic"]), losses(runs["resumed"])
    assert all(resumed[s] == whole[s] for s in range(7, 13)), (resumed, whole)

    def final(run):
        tag = run[0] / "checkpoints" / (run[0] / "checkpoints" / "latest").read_text().strip()
        return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]

    a, b = final(runs["stochastic"]), final(runs["resumed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("ds, why", [
    ("zero2.json", "fp32 master weights"),
    ("zero3_offload.json", "fp32 master weights"),
])
def test_stochastic_rounding_true_is_refused_where_nothing_rounds(ds, why, tmp_path, capfd, monkeypatch):
    import engine.pretrain as pretrain

    (tmp_path / "r.yaml").write_text(RECIPE.replace("STEPS", "2").replace("SR", "true"))
    p = run_in_process(pretrain.main, ["--deepspeed_config", str(ROOT / "ds_configs" / ds), "--config",
                                       str(tmp_path / "r.yaml"), "--run_dir", str(tmp_path / "run")], capfd,
                       monkeypatch, cwd=tmp_path)
    assert p.returncode == 2 and "train.stochastic_rounding: true" in p.stderr and why in p.stderr, p.stderr
    assert not (tmp_path / "run").exists()


def test_stochastic_rounding_true_is_refused_with_an_offloaded_or_other_optimizer(tmp_path, capfd, monkeypatch):
    import engine.pretrain as pretrain

    base = ROOT / "ds_configs" / "zero2_bf16_states.json"
    cfg = json.loads(base.read_text())
    cases = {"offloaded": {"zero_optimization": {**cfg["zero_optimization"],
                                                 "offload_optimizer": {"device": "cpu"}}},
             "amsgrad": {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "amsgrad": True}}},
             "'Lamb'": {"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}}
    (tmp_path / "r.yaml").write_text(RECIPE.replace("STEPS", "2").replace("SR", "true"))
    for why, change in cases.items():
        ds = write_ds(tmp_path / "ds.json", base, **change)
        p = run_in_process(pretrain.main, ["--deepspeed_config", str(ds), "--config", str(tmp_path / "r.yaml"),
                                           "--run_dir", str(tmp_path / "run")], capfd, monkeypatch, cwd=tmp_path)
        assert p.returncode == 2 and "train.stochastic_rounding: true" in p.stderr and why in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_each_rank_rounds_with_its_own_noise(monkeypatch):
    """AdamWSR's rounding noise is seeded by rank too: two data-parallel ranks updating the same bf16 weights with the
    same gradient (ZeRO-1/2 replicas of one parameter would) draw different noise. [fails if: the rank is left out
    of the seed, so every rank's rounding errors are the same and do not average out]"""
    torch.manual_seed(0)
    w0, g = torch.randn(4096).bfloat16(), torch.randn(4096).bfloat16()
    out = []
    for rank in (0, 1):
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda r=rank: r)
        p = w0.clone().requires_grad_()
        opt = AdamWSR([p], lr=1e-3, seed=1)
        p.grad = g.clone()
        opt.step()
        out.append(p.detach())
    assert not torch.equal(out[0], out[1])
