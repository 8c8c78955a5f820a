"""engine/flops.py's, engine/metrics.py's and engine/balance.py's rules that the other fast tests let through, one
mutant a test (several where one input tells them apart): the FLOP count's attention head-dim fallback (hidden /
heads, not / kv heads), sliding-window layers counted as softmax attention, an output layer tied to the embedding
still counted, pipeline stages summed; the peak's device argument and whole-word match at the start, no peak off
CUDA; print0 and Metrics on rank 0 only (RANK unset is rank 0), a resumed run's metrics.jsonl appended after its
later rows are set aside, written through at once, the bar's total, start and advance, the piped line's fields and 4
significant digits, no set-aside note when nothing is later, NaN reaching the monitor; DeviceClock on CUDA (ms to s,
the order of the marks, the wait); ExpertBalance without a routing bias at rate 0, a dense model and a pipeline
stage without MoE layers, and the ratio's 3 decimals; and in engine/pretrain.py's row built from them, a
checkpoint's time left out of the next row's window only, no `mfu` without a known peak. Each expected value is
worked out by hand from the documented formula (engine/flops.py's docstring, docs/benchmarks.md "MFU =",
docs/metrics.md); nothing here needs a launcher, and the only model is built on the meta device. The docstring's
bracket names the mutant."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from engine.flops import model_flops_per_token, peak_for_name, peak_tflops
from test_replay_balance_units import _Layer, _model
from test_watchdog_metrics_units import fake_engine, steps_in


# ------------------------------------------------------------------------------------------------ engine/flops.py

def test_head_dim_falls_back_to_hidden_over_query_heads_and_sliding_layers_are_softmax():
    """A config without head_dim (Mixtral's config.json: head_dim None) and with layer_types: qk = v = hidden 32 /
    4 query heads = 8 (not / 2 kv heads = 16, not 32); a sliding-window layer is softmax attention (the full seq x seq
    square, as every softmax layer), only the linear-attention layer pays none: 2 softmax layers of 3.
    active: fused experts 400 at top-1 of 4 = 100, + lm_head 50 = 150; total 70 (embedding) + 400 + 50 = 520.
    attention 3 x 2 layers x 2 x seq 10 x 4 heads x (8 + 8) = 7680; FLOPs 6 x 150 + 7680 = 8580.
    [kills: hidden // num_key_value_heads; hidden without // heads; only "full_attention" layers counted]"""
    cfg = SimpleNamespace(num_experts=4, num_experts_per_tok=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=None, hidden_size=32, num_hidden_layers=3,
                          layer_types=["sliding_attention", "full_attention", "linear_attention"])
    engine = fake_engine({"model.embed_tokens.weight": 70, "model.layers.0.mlp.experts.gate_up_proj": 400,
                          "lm_head.weight": 50})
    assert model_flops_per_token(engine, cfg, seq_len=10, ep=1) == (8580.0, 520.0, 150.0)


def test_an_output_layer_tied_to_the_embedding_is_still_counted():
    """A Qwen3-MoE of 1 layer (vocabulary 100, hidden 16, 2 heads of 8, 4 experts of width 8, top-2) on the meta
    device: named_parameters() lists a tied lm_head once, as the embedding, but the output layer's matmul runs all
    the same ("6 x active non-embedding parameters, the output layer included"). By hand:
    attention q/k/v/o 4 x 16 x 16 = 1024 + q/k norms 2 x 8 = 1040; two layer norms 32; router 4 x 16 = 64; experts
    gate_up 4 x 16 x 16 = 1024 + down 4 x 8 x 16 = 512 = 1536, active at 2/4: 768; final norm 16; output layer
    100 x 16 = 1600. active 1040 + 32 + 64 + 768 + 16 + 1600 = 3520; attention 3 x 1 x 2 x seq 8 x 2 x (8 + 8) = 1536;
    FLOPs 6 x 3520 + 1536 = 22656, tied or not. total 5888 untied, 5888 - 1600 = 4288 tied (one tensor).
    [fails if: a tied output layer drops out of the active parameters (MFU low by 6 x vocab x hidden per token)]"""
    from transformers import AutoConfig, AutoModelForCausalLM

    got = {}
    for tie in (False, True):
        c = AutoConfig.for_model("qwen3_moe", vocab_size=100, hidden_size=16, intermediate_size=32,
                                 moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                 tie_word_embeddings=tie)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(c)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        got[tie] = model_flops_per_token(SimpleNamespace(module=model, config={}), c, 8, 1)
    assert got == {False: (22656.0, 5888.0, 3520.0), True: (22656.0, 4288.0, 3520.0)}


def test_pipeline_stages_are_summed_over_the_stages_once(monkeypatch):
    """Pipeline, 2 stages x 2 data-parallel replicas: this rank (stage 0) holds the embedding (1000) and one attention
    weight (300); stage 1 holds the output layer (1000). The all-reduce adds this stage's twin and stage 1's two
    ranks: (2 x 1300 + 2 x 1000, 2 x 300 + 2 x 1000) / dp 2 = total 2300, active 1300.
    attention 3 x 2 layers x 2 x seq 4 x 2 heads x (4 + 4) = 768; FLOPs 6 x 1300 + 768 = 8568.
    [fails if: the pipeline sum is skipped (this stage's 1300 / 300 alone)]"""
    cfg = SimpleNamespace(num_experts=4, num_experts_per_tok=1, num_attention_heads=2, head_dim=4, hidden_size=8,
                          num_hidden_layers=2)
    engine = fake_engine({"0.embed_tokens.weight": 1000, "1.layer.self_attn.q_proj.weight": 300})
    engine.config = {"pipeline": {"stages": 2}}
    engine.device, engine.grid = "cpu", SimpleNamespace(data_parallel_size=2)

    def all_reduce(t):
        t.mul_(2).add_(torch.tensor([2000.0, 2000.0], dtype=t.dtype))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert model_flops_per_token(engine, cfg, seq_len=4, ep=1) == (8568.0, 2300.0, 1300.0)


def test_peak_reads_the_named_cuda_device_and_nothing_off_cuda(monkeypatch):
    """Two GPUs of different models: cuda:1's name gives its peak (an H100 PCIe, 756), not the current device's
    (an H200, 989); a device that is not CUDA (an Intel XPU) has no peak, even where a CUDA GPU is present.
    [kills: get_device_name() without the device; `device.type == "cpu"` as the only no-peak case]"""
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 PCIe"}

    def name(device=None):
        return names[0 if device is None or torch.device(device).index is None else torch.device(device).index]

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    assert peak_tflops("cuda:1") == 756.0 and peak_tflops(torch.device("cuda", 0)) == 989.0
    assert peak_tflops("xpu") is None


def test_a_listed_model_at_the_end_of_a_longer_name_is_not_matched():
    """Whole words at both ends: "QH200" (no such card) is not an "H200"; the Grace Hopper superchip's "GH200" is
    its own entry, an H100's peak. [kills: the leading \\b of peak_for_name's pattern dropped]"""
    assert peak_for_name("NVIDIA QH200 141GB") is None
    assert peak_for_name("NVIDIA GH200 480GB") == 989.0


# ---------------------------------------------------------------------------------------------- engine/metrics.py

def test_print0_and_metrics_are_rank_0s_with_rank_unset_as_rank_0(tmp_path, monkeypatch, capsys):
    """RANK unset (a plain `python bin/...` run) is rank 0: print0 prints and Metrics writes; RANK=1 prints nothing
    and writes nothing, not even the run dir. [kills: RANK defaulting to anything but 0; print0 on rank != 0]"""
    from engine.metrics import Metrics, print0

    monkeypatch.delenv("RANK", raising=False)
    print0("zero")
    m = Metrics(tmp_path / "r0", total_steps=2)
    m.log({"step": 1, "loss": 1.0})
    m.close()
    monkeypatch.setenv("RANK", "1")
    print0("one")
    m = Metrics(tmp_path / "r1", total_steps=2)
    m.log({"step": 1, "loss": 1.0})
    m.close()
    assert capsys.readouterr().out.splitlines() == ["zero", "step 1 loss 1"]
    assert steps_in(tmp_path / "r0" / "metrics.jsonl") == [1] and not (tmp_path / "r1").exists()


class Bar:
    """tqdm as Metrics calls it, shown (a terminal): records its arguments, postfixes, updates and close."""

    def __init__(self, **kw):
        self.kw, self.disable, self.postfix, self.updates, self.closed = kw, False, [], [], False

    def set_postfix(self, d, refresh=True):
        self.postfix.append(d)

    def update(self, n):
        self.updates.append(n)

    def close(self):
        self.closed = True


def test_a_resumed_run_appends_after_setting_later_rows_aside_and_writes_through(tmp_path, monkeypatch, capsys):
    """Resumed at step 2 with rows 1, 2, 3 on disk (3 written before a crash): row 3 moves to metrics.replaced.jsonl,
    rows 1 and 2 stay, the new row 3 is appended after them and is on disk at once (before close: a reader follows
    the file during the run). The bar (a terminal) spans 10 steps from 2, advances by the count given, shows loss
    and tokens/s at 4 significant digits, and the row is not also printed. close() closes the bar and the file.
    [kills: set_aside at step 0 or not at all; metrics.jsonl opened "w"; no flush; the bar's total or initial lost;
    advance(n) as 1; no postfix]"""
    import tqdm

    from engine.metrics import Metrics

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3)))
    m = Metrics(run, total_steps=10, start_step=2)
    capsys.readouterr()  # the set-aside note
    m.log({"step": 3, "loss": 0.5, "tokens_per_s": 52346.0})
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2},
                    {"step": 3, "loss": 0.5, "tokens_per_s": 52346.0}]
    assert steps_in(run / "metrics.replaced.jsonl") == [3]
    m.advance(3)
    bar = m.bar
    assert (bar.kw["total"], bar.kw["initial"], bar.updates) == (10, 2, [3])
    assert bar.postfix == [{"loss": "0.5", "tokens_per_s": "5.235e+04"}]
    m.close()
    assert bar.closed and m.file.closed and capsys.readouterr().out == ""


def test_a_piped_line_shows_every_listed_field_at_4_significant_digits(tmp_path, monkeypatch, capsys):
    """Piped (no bar), a GRPO-like row prints step, loss, reward, eval_reward, kl, lr and tokens_per_s in that order,
    each at 4 significant digits (1.23456 -> 1.235, 52346 -> 5.235e+04), nothing else (grad_norm is not shown).
    [kills: a listed field dropped from the printed line; .3g instead of .4g]"""
    from engine.metrics import Metrics

    monkeypatch.setenv("RANK", "0")
    m = Metrics(tmp_path / "run", total_steps=10)
    m.log({"step": 5, "loss": 1.23456, "reward": 0.5, "eval_reward": 0.25, "kl": 0.001234, "lr": 3e-4,
           "tokens_per_s": 52346.0, "grad_norm": 1.0})
    m.close()
    assert capsys.readouterr().out == ("step 5 loss 1.235 reward 0.5 eval_reward 0.25 kl 0.001234 lr 0.0003 "
                                       "tokens_per_s 5.235e+04\n")


def test_no_rows_past_the_start_moves_nothing_and_says_nothing(tmp_path, capsys):
    """Resuming at step 3 with rows 1-3: nothing is later, so no note, no metrics.replaced.jsonl, the file as it was.
    [kills: the `if not later: return` early exit dropped (an empty set-aside and a "0 rows" note)]"""
    from engine.metrics import set_aside_later_rows

    run = tmp_path / "run"
    run.mkdir()
    text = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    (run / "metrics.jsonl").write_text(text)
    set_aside_later_rows(run, 3)
    assert (run / "metrics.jsonl").read_text() == text
    assert not (run / "metrics.replaced.jsonl").exists() and capsys.readouterr().out == ""


def test_a_diverged_loss_reaches_the_monitor_as_nan_and_the_file_as_null(tmp_path, monkeypatch):
    """A NaN loss is a number for DeepSpeed's monitor (TensorBoard and wandb plot it: the divergence is visible
    there), and null in metrics.jsonl (standard JSON). [kills: the monitor fed the JSON row, finite(row), which drops
    the NaN]"""
    from engine.metrics import Metrics

    monkeypatch.setenv("RANK", "0")
    sent = []
    m = Metrics(tmp_path / "run", total_steps=10, monitor=SimpleNamespace(enabled=True, write_events=sent.append))
    m.log({"step": 4, "loss": float("nan")})
    m.close()
    [[(key, value, step)]] = sent
    assert (key, step) == ("Train/loss", 4) and math.isnan(value)
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == {"step": 4, "loss": None}


def test_device_clock_on_cuda_reads_event_milliseconds_as_seconds_from_a_to_b():
    """On CUDA a mark is an event recorded on the stream (here at 1000 ms and 3500 ms); seconds(a, b) is
    a.elapsed_time(b) = 2500 ms = 2.5 s, positive from the earlier mark; wait(b) synchronizes on b.
    [kills: ms not divided by 1000; b.elapsed_time(a); record() not called; wait without synchronize()]"""
    from engine.metrics import DeviceClock

    times = [1000.0, 3500.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.timing, self.at, self.synced = enable_timing, None, False

        def record(self):
            self.at = times.pop(0)

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, end):  # milliseconds from self to end, as torch.cuda.Event's
            return end.at - self.at

    clock = DeviceClock(SimpleNamespace(device_name=lambda: "cuda", Event=Event))
    a, b = clock.mark(), clock.mark()
    clock.wait(b)
    assert b.synced and a.timing and clock.seconds(a, b) == 2.5


# ---------------------------------------------------------------------------------------------- engine/balance.py

def test_a_model_without_a_routing_bias_is_measured_at_rate_0_and_refused_above():
    """Qwen3-MoE and Mixtral have no e_score_correction_bias: at balance_rate 0 their load is still measured (no
    error, no bias touched), at any rate > 0 ExpertBalance refuses. [kills: `rate > 0` as `rate >= 0` in __init__ or
    in after_step; the missing-bias check dropped]"""
    from engine.balance import ExpertBalance

    layer = _Layer()
    del layer.router.e_score_correction_bias
    bal = ExpertBalance(_model(layer), rate=0.0)
    layer.tokens_per_expert += torch.tensor([3, 1, 0, 0])
    bal.after_step()
    assert bal.load_stats() == {"expert_load_max_over_mean": [3.0]}  # max 3 / mean 1
    with pytest.raises(ValueError, match="needs a routing-bias buffer"):
        ExpertBalance(_model(layer), rate=0.01)


def test_a_dense_model_skips_the_all_reduce_but_a_stage_without_moe_layers_joins_it(monkeypatch):
    """No MoE layer in the model (total 0): no all-reduce, no stats. A pipeline stage holding none of the model's 2
    MoE layers (rows [], total 2, 4 experts) still joins the all-reduce every rank makes, with zeros, and reports
    the other stage's loads: row 0 all 0 (max/mean 0), row 1 [5, 3, 3, 3]: 5 / 3.5 = 1.428571 -> 1.429 (3 decimals).
    [kills: the `not self.total` early return dropped, or tested on the local layers (the stage's rank skips the
    collective the others wait in); round to 2 decimals]"""
    import torch.distributed as dist

    from engine.balance import ExpertBalance

    calls = []

    def all_reduce(t, *args, **kwargs):
        calls.append(tuple(t.shape))
        t += torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, 3.0, 3.0, 3.0]])

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    dense = ExpertBalance(torch.nn.Linear(2, 2), rate=0.0)
    dense.after_step()
    assert calls == [] and dense.load_stats() == {}
    stage = ExpertBalance(torch.nn.Linear(2, 2), rate=0.01, rows=[], total=2, num_experts=4)
    stage.after_step()
    assert calls == [(2, 4)] and stage.load_stats() == {"expert_load_max_over_mean": [0.0, 1.429]}


# ------------------------------------------------------------------- engine/pretrain.py: the row built from them

def test_a_checkpoints_time_is_left_out_of_the_next_row_only(monkeypatch):
    """docs/metrics.md: tokens_per_s is over the steps since the previous row, less the time spent saving in
    between. One save, at step 2 (100 s, after row 2), steps of 10 s, rows at 2, 4 and 6 (192 tokens a step): row 4's
    window is 20 + 100 - 100 = 20 s; row 6's is its own 20 s, not 20 - 100 (the save subtracted again).
    [fails if: the saving time is not reset with each row's window (a negative rate at row 6)]"""
    from test_pretrain_units import FakeCadence, run_train

    class AtStep2(FakeCadence):
        def due(self, step, max_steps):
            return step == 2, False

    rows, seen = run_train(monkeypatch, max_steps=6, losses=(1.0,) * 6, cadence=AtStep2())
    assert [s["step"] for s in seen["saves"]] == [2]
    assert [r["tokens_per_s"] for r in rows] == pytest.approx([2 * 96 / 20] * 3)  # 1 rank: micro 3 x accum 2 x 16


def test_no_mfu_on_a_device_without_a_known_peak(monkeypatch):
    """docs/metrics.md: `mfu` only on H100/H200/H800/H20/A100/A800 (peak_tflops gives None elsewhere). One rank,
    96 tokens a step (micro 3 x accum 2 x seq 16), 2 steps of 10 s a row: 9.6 tokens/s, x 2e9 FLOPs per token / 1e12
    = 0.0192 TFLOP/s per rank, and no `mfu` key. [fails if: an mfu is written against a made-up peak]"""
    from test_pretrain_units import run_train

    rows, _ = run_train(monkeypatch)
    assert "mfu" not in rows[0] and rows[0]["tflops_per_s_per_rank"] == pytest.approx(9.6 * 2e9 / 1e12)
