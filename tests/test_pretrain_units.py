"""Unit checks of engine/pretrain.py's training loop (train(): its rows' rates and means across ranks, the tokens and
data position on a resume, what a stop saves, a data stop) and of its small helpers and preflight wiring, with fakes
in place of the DeepSpeed engine, torch.distributed and the clock. No launcher: the whole file runs in seconds."""
from types import SimpleNamespace as NS

import pytest
import torch

import engine.checkpoint
import engine.pretrain as pretrain
from engine.config import ConfigError, load_recipe
from engine.parallel import World


class FakeCadence:
    """checkpoint.Cadence: `stop_at` is the step after which it says (save, stop); fail() stops (saving) at once."""

    def __init__(self, stop_at=None):
        self.stop_at, self.failed, self._fail = stop_at, False, False

    def __call__(self, *a, **k):
        return self

    def fail(self):
        self._fail = True

    def agree_failed(self):
        self.failed = self._fail
        return self.failed

    def due(self, step, max_steps):
        self.failed = self._fail
        stop = self.failed or step == self.stop_at
        return stop or step == max_steps, stop

    def why(self):
        return "signal 15"

    def close(self):
        pass


class Nothing:
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):  # advance, after_step, close: nothing to do
        return lambda *a, **k: None

    def load_stats(self):
        return {}


def run_train(monkeypatch, *, max_steps=4, log_every=2, losses=(1.0, 3.0, 5.0, 7.0), world=World(0, 1, 1),
              micro=3, accum=2, cadence=None, fill_fails_at=None, peak=None, resume=None, config=None):
    """train() with fakes: each step takes 10 s of the fake clock and each save 100 s; the other ranks (world.size)
    have the same losses (all_reduce multiplies by the world size). Returns (rows, what was seen)."""
    seen = {"saves": [], "printed": [], "micro_batches": [], "flops_args": [], "fills": 0}
    now = [1000.0]
    losses = iter(losses)

    def step_fn(eng, batches, acc, position):
        now[0] += 10.0
        return position + acc, torch.tensor(next(losses))

    class Batches:
        error = ConfigError("row 9 is not text") if fill_fails_at is not None else None

        def __init__(self, it, acc):
            self.fills = 0

        def fill(self):  # True: this rank cannot read the next step's data
            seen["fills"] += 1
            return fill_fails_at is not None and seen["fills"] >= fill_fails_at

    def save(eng, recipe, state, tok):
        now[0] += 100.0
        seen["saves"].append(dict(state))

    def flops(*a):
        seen["flops_args"].append(a)
        return (2e9, 0)

    rows = []
    monkeypatch.setattr(pretrain, "zero_step", step_fn)
    monkeypatch.setattr(pretrain, "ReadAhead", Batches)
    monkeypatch.setattr(pretrain, "ExpertBalance", Nothing)
    monkeypatch.setattr(pretrain, "Metrics", lambda *a: NS(advance=lambda: None, close=lambda: None, log=rows.append))
    monkeypatch.setattr(pretrain, "model_flops_per_token", flops)
    monkeypatch.setattr(pretrain, "peak_tflops", lambda device: peak)
    monkeypatch.setattr(pretrain, "memory_stats", lambda: {})
    monkeypatch.setattr(pretrain, "print0", seen["printed"].append)
    monkeypatch.setattr(pretrain, "time", NS(time=lambda: now[0]))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: t.mul_(world.size))
    monkeypatch.setattr(engine.checkpoint, "Cadence", cadence or FakeCadence())
    monkeypatch.setattr(engine.checkpoint, "save", save)
    if resume is not None:
        monkeypatch.setattr(engine.checkpoint, "load", lambda eng, run_dir, lr: dict(resume))
    recipe = load_recipe(None, {"train.max_steps": max_steps, "train.log_every": log_every, "data.seq_len": 16,
                                **({"resume": True} if resume is not None else {})})
    dp = world.size
    eng = NS(module=NS(config="hf"), config=config or {}, device="cpu", monitor=None, get_lr=lambda: [0.5],
             train_micro_batch_size_per_gpu=lambda: micro, gradient_accumulation_steps=lambda: accum,
             train_batch_size=lambda: micro * accum * dp)
    data = NS(micro_batches=lambda *a, **k: seen["micro_batches"].append((a, k)) or iter(()))
    got = pretrain.train(recipe, eng, data, None, world)
    assert got == rows
    return got, seen


def test_a_rows_rates_are_the_whole_jobs_and_per_rank_and_its_loss_the_mean_over_ranks(monkeypatch):
    """Two ranks, micro-batch 3 x accumulation 2, seq_len 16: a step is train_batch_size 12 x 16 = 192 tokens (the
    job's, not one micro-batch's); a row of 2 steps of 10 s each has tokens_per_s 19.2, per rank 9.6, TFLOP/s per
    rank 9.6 x 2e9 / 1e12 and an MFU of that over the device's peak (100); the loss is the mean over steps and ranks.
    [fails if: the tokens per step count one micro-batch, the loss is not divided by the world size, tokens_per_s is
    the per-rank rate, or the MFU leaves the TFLOP/s in FLOP/s]"""
    rows, _ = run_train(monkeypatch, world=World(0, 2, 2), peak=100.0)
    assert [r["step"] for r in rows] == [2, 4] and [r["loss"] for r in rows] == [2.0, 6.0]
    assert [r["tokens"] for r in rows] == [2 * 192, 4 * 192] and rows[0]["world_size"] == 2
    r = rows[0]
    assert r["tokens_per_s"] == pytest.approx(19.2) and r["tokens_per_s_per_rank"] == pytest.approx(9.6)
    assert r["tflops_per_s_per_rank"] == pytest.approx(9.6 * 2e9 / 1e12)
    assert r["mfu"] == pytest.approx(9.6 * 2e9 / 1e12 / 100)
    assert r["lr"] == 0.5 and r["skipped_steps"] == 0


def test_the_flops_per_token_count_the_expert_parallel_size(monkeypatch):
    """model_flops_per_token gets the engine, the model's config, seq_len and the autoep_size (1 without an
    expert_parallel section). [fails if: the missing autoep_size defaults to anything but 1]"""
    _, seen = run_train(monkeypatch)
    assert seen["flops_args"][0][1:] == ("hf", 16, 1)
    _, seen = run_train(monkeypatch, config={"expert_parallel": {"autoep_size": 4}})
    assert seen["flops_args"][0][1:] == ("hf", 16, 4)


def test_a_stop_writes_a_row_and_saves_the_step_its_position_and_its_tokens(monkeypatch):
    """A stop (signal or stop file) after step 3 of 6 with log_every 2: a row at step 3 (one step since the last
    row), a save of {step 3, position 6 (3 steps x accumulation 2), tokens 3 x 192} whose 100 s are left out of the
    next row's rate window, and the line that says how to continue. [fails if: a stop off the log cadence writes no
    row, the saved state's fields are swapped or wrong, or the save's time counts in the rate]"""
    rows, seen = run_train(monkeypatch, max_steps=6, losses=(1.0, 3.0, 5.0), world=World(0, 2, 2),
                           cadence=FakeCadence(stop_at=3))
    assert [(r["step"], r["loss"], r["tokens"]) for r in rows] == [(2, 2.0, 384), (3, 5.0, 576)]
    assert seen["saves"] == [{"step": 3, "position": 6, "tokens": 576}]
    assert seen["printed"] == ["stopped by signal 15 after step 3; saved, continue with --resume"]


def test_the_time_spent_saving_is_left_out_of_the_rate(monkeypatch):
    """A checkpoint saved at step 2 (100 s on the fake clock) between rows: the row at step 4 covers 2 steps of 10 s,
    so 192 x 2 / 20 tokens/s, not / 120. [fails if: the saving time is not subtracted from the window]"""

    class EverySecond(FakeCadence):
        def due(self, step, max_steps):
            return step % 2 == 0, False

    rows, seen = run_train(monkeypatch, world=World(0, 2, 2), cadence=EverySecond())
    assert [s["step"] for s in seen["saves"]] == [2, 4]
    assert rows[1]["tokens_per_s"] == pytest.approx(2 * 192 / 20)


def test_a_resume_goes_on_from_the_saved_position_tokens_and_step(monkeypatch):
    """Resumed at step 3 (position 6, 576 tokens) of 6, log_every 2: the data starts at position 6 with this rank's
    micro-batch and data-parallel coordinates, the first row (step 4) covers the one step since the resume, and the
    tokens go on from 576. [fails if: the data restarts at 0, or the tokens or the steps since the last row restart
    at 0]"""
    rows, seen = run_train(monkeypatch, max_steps=6, losses=(5.0, 7.0, 9.0), world=World(1, 2, 2),
                           resume={"step": 3, "position": 6, "tokens": 576})
    assert seen["micro_batches"] == [((3, 1, 2), {"start": 6})]
    assert [(r["step"], r["loss"], r["tokens"]) for r in rows] == [(4, 5.0, 768), (6, 8.0, 1152)]
    assert rows[0]["tokens_per_s"] == pytest.approx(192 / 10)


def test_a_resume_at_max_steps_says_there_is_nothing_to_train(monkeypatch):
    """A checkpoint already at train.max_steps: the note, no step, no row. [fails if: the check is `>`]"""
    rows, seen = run_train(monkeypatch, max_steps=4, losses=(), resume={"step": 4, "position": 8, "tokens": 768})
    assert rows == [] and seen["printed"] == [engine.checkpoint.nothing_to_train(4, "train.max_steps (4)")]


def test_the_data_is_not_read_past_the_last_step(monkeypatch):
    """The next step's data is read before agreeing to go on, but not after the last step: a source that has exactly
    the run's batches (a read past them fails) ends the run normally. [fails if: the read-ahead also runs after the
    last step, turning a clean end into a data stop]"""
    rows, seen = run_train(monkeypatch, max_steps=4, fill_fails_at=5)
    assert seen["fills"] == 4 and [r["step"] for r in rows] == [2, 4]


def test_a_data_stop_names_the_unread_step_and_whether_it_saved(monkeypatch):
    """Data unreadable before step 1: DataStop for step 1, nothing saved. Unreadable before step 3 (read during step
    2): a row and a save at step 2, and DataStop for step 3 saying step 2 was saved. [fails if: the step named is
    off by one, or the save is not reported]"""
    with pytest.raises(pretrain.DataStop) as e:
        run_train(monkeypatch, fill_fails_at=1)
    assert (e.value.step, e.value.saved) == (1, False)
    assert str(e.value) == "row 9 is not text (reading the data of step 1)"
    with pytest.raises(pretrain.DataStop) as e:
        run_train(monkeypatch, fill_fails_at=3)
    assert (e.value.step, e.value.saved) == (3, True) and "saved step 2" in str(e.value)


# ---------------------------------------------------------------- small helpers


def test_out_of_memory_is_read_in_any_case_and_only_from_such_errors():
    """[fails if: the text is matched case-sensitively ("Out of memory" from a library), or "ALLOC_FAILED" is
    dropped]"""
    assert pretrain.is_out_of_memory(RuntimeError("NCCL error: Out Of Memory"))
    assert pretrain.is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))
    assert pretrain.is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not pretrain.is_out_of_memory(RuntimeError("shape mismatch"))


def test_the_out_of_memory_line_says_what_was_wanted_without_the_free_figure(monkeypatch):
    """torch's message with "Tried to allocate" but no capacity clause: the wanted figure alone. [fails if: the free
    clause is used whenever either is found (then a None match is read)]"""
    monkeypatch.setattr(pretrain, "peak_memory_gib", lambda: 3.0)
    line = pretrain.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."),
                                  {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, True, "x")
    assert line.startswith("out of device memory while training at micro-batch 4 x accumulation 2: 2.00 GiB wanted "
                           "(peak 3.0 GiB allocated)"), line


def test_peak_memory_on_cuda_is_in_gib(monkeypatch):
    """[fails if: the bytes of max_memory_allocated are divided by 2**20]"""
    import deepspeed.accelerator

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator",
                        lambda: NS(device_name=lambda: "cuda", max_memory_allocated=lambda: 3 * 2**30 + 2**29))
    assert pretrain.peak_memory_gib() == 3.5


def test_a_taken_rendezvous_port_stops_the_ranks(monkeypatch):
    """init_distributed raising ConfigError (the port is taken): reported once, and start_ranks says no. [fails if:
    the ranks are started anyway]"""
    seen = []

    def taken(**k):
        raise ConfigError("port 29500 is taken")

    monkeypatch.setattr(pretrain, "init_distributed", taken)
    monkeypatch.setattr(pretrain, "print_error", seen.append)
    assert pretrain.start_ranks(World(0, 1, 1), None) is False
    assert seen == ["error: port 29500 is taken"]


def test_report_error_without_local_rank_is_a_first_rank(monkeypatch):
    """A rank started without LOCAL_RANK in its environment counts as its node's first rank. [fails if: the default
    is not "0"]"""
    seen = []
    monkeypatch.setattr(pretrain, "print_error", seen.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr("socket.gethostname", lambda: "hostB")
    pretrain.report_error(ValueError("boom"), World(2, 4, 2))
    assert seen == ["error on hostB (rank 2): boom"]


def test_a_refusing_rank_whose_peers_never_come_says_its_own_problem(monkeypatch):
    """fail_together: the rendezvous timing out (TimeoutError) gives this rank's own problem. [fails if:
    TimeoutError is not caught]"""

    def init(**k):
        raise TimeoutError("no peers")

    monkeypatch.setattr(pretrain, "peer_timeout", lambda: 600)
    monkeypatch.setattr(pretrain, "init_distributed", init)
    assert pretrain.fail_together(World(1, 2, 2), ConfigError("mine")) == "mine"


class Block(torch.nn.Module):  # a block with shared experts (AutoEP's layer where a test says so)
    def __init__(self):
        super().__init__()
        self.shared_experts = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.shared_experts(x)


class Layer(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.mlp = Block() if moe else torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.mlp(x)


class FakeModel(torch.nn.Module):
    """A decoder's shape as compile_layers reads it: get_decoder().layers."""

    def __init__(self, n, moe=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(moe) for _ in range(n)])

    def get_decoder(self):
        return self


def test_compile_layers_keeps_a_higher_recompile_limit(monkeypatch):
    """compile_layers raises torch's recompile limit to what its layers need (2 per layer, 2 more), never lowers one
    set higher. [fails if: the limit is set, not raised, or the 2 more are left out]"""
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, options=None: fn)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)  # restored after the test
    assert pretrain.compile_layers(FakeModel(2)) == ["layers.0", "layers.1"]
    assert torch._dynamo.config.recompile_limit == 64
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    pretrain.compile_layers(FakeModel(2))
    assert torch._dynamo.config.recompile_limit == 2 * 2 + 2


# ---------------------------------------------------------------- preflight's wiring


def preflight_on(tmp_path, world, *argv, ds=None):
    from conftest import ZERO3

    args = pretrain.parse_args(["--deepspeed_config", str(ds or ZERO3), "--run_dir", str(tmp_path / "run"), *argv])
    return pretrain.preflight(args, world)


def test_a_resume_on_another_layout_converts_the_checkpoint_once_on_rank_0(tmp_path, monkeypatch):
    """check_resume saying the checkpoint needs DeepSpeed's universal form: every rank's resolved config loads it
    (checkpoint.load_universal), and only rank 0 converts `latest`. [fails if: another rank converts, or rank 0
    does not]"""
    converted = []
    monkeypatch.setattr(engine.checkpoint, "check_resume", lambda recipe, ds, size, rank: ([], True))
    monkeypatch.setattr(engine.checkpoint, "run_dir_problems", lambda recipe: [])
    for rank in (0, 1):
        convert = lambda run_dir, rank=rank: converted.append((rank, run_dir))  # noqa: E731
        monkeypatch.setattr(engine.checkpoint, "to_universal", convert)
        recipe, ds, _ = preflight_on(tmp_path, World(rank, 2, 2), "--resume")
        assert ds["checkpoint"]["load_universal"] is True
    assert converted == [(0, str(tmp_path / "run"))]


def test_preflight_checks_host_memory_and_the_corpus_for_the_ranks_that_run(tmp_path, monkeypatch):
    """host_memory_problem gets the ranks on this node, at most the world (a node with more slots than the job
    uses); check_corpus gets the batch and the data-parallel size, the world's size when the DS config is broken.
    [fails if: the node's slots are passed as its ranks, or a broken DS config checks the corpus for one rank]"""
    seen = []
    monkeypatch.setattr(pretrain, "host_memory_problem", lambda ds, recipe, size, local: seen.append(("host", local)))
    monkeypatch.setattr(pretrain, "check_corpus", lambda data, tok, batch, dp: seen.append(("corpus", batch, dp)) or [])
    _, ds, _ = preflight_on(tmp_path, World(0, 2, 4))
    assert seen == [("corpus", ds["train_batch_size"], 2), ("host", 2)]
    seen.clear()
    with pytest.raises(ConfigError):
        preflight_on(tmp_path, World(0, 2, 2), ds=tmp_path / "missing.json")
    assert seen == [("corpus", None, 2)]


def test_ranks_disagreeing_are_named_low_to_high_with_a_real_max_reduction(monkeypatch):
    """check_ranks_agree's one all_reduce with the op it asks for, done as torch would against another rank of
    micro-batch 4: the line names the range low to high, 4-8. [fails if: the reduction is not MAX (the range then
    reads 8-4)]"""
    import torch.distributed as dist

    theirs = torch.tensor([4, 1, 1, 2, -4, -1, -1, -2])

    def all_reduce(t, op):
        t.copy_(torch.maximum(t, theirs) if op == dist.ReduceOp.MAX else torch.minimum(t, theirs))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(ConfigError, match=r"different batch sizes \(micro-batch 4-8, accumulation 1-1\)"):
        pretrain.check_ranks_agree({"train_micro_batch_size_per_gpu": 8}, World(0, 2, 2))


def test_differing_expert_sizes_on_nodes_of_equal_slots_add_no_nodes_note(monkeypatch):
    """Expert-parallel sizes 2 and 4 from nodes that run the same number of ranks (2): the line names the sizes and
    says nothing about the hostfile's slots. [fails if: the nodes' note is added whatever their rank counts]"""
    import torch.distributed as dist

    theirs = torch.tensor([8, 1, 4, 2, -8, -1, -4, -2])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op: t.copy_(torch.maximum(t, theirs)))
    ds = {"train_micro_batch_size_per_gpu": 8, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    with pytest.raises(ConfigError) as e:
        pretrain.check_ranks_agree(ds, World(0, 4, 2))
    assert "expert_parallel.autoep_size (2-4): \"auto\" follows the ranks on each node" in str(e.value), e.value


def test_compile_layers_twice_leaves_autoep_blocks_alone_the_second_time(monkeypatch):
    """compile_layers keeps each AutoEP block's routing eager (torch.compiler.disable) and compiles its shared experts;
    called again on the same model (GRPO's policy), blocks already made eager are skipped: their shared experts are
    not compiled a second time. [fails if: the already-disabled check is dropped]"""
    import deepspeed.module_inject.auto_ep_layer as auto_ep

    compiled = []
    monkeypatch.setattr(auto_ep, "AutoEPMoELayer", Block)  # AutoEP's layer, as compile_layers finds it
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, options=None: compiled.append(fn) or fn)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)  # restored after the test
    model = FakeModel(1, moe=True)
    assert pretrain.compile_layers(model) == ["layers.0.mlp.shared_experts", "layers.0"]
    assert getattr(model.layers[0].mlp.forward, "_torchdynamo_disable", False)
    assert pretrain.compile_layers(model) == ["layers.0"] and len(compiled) == 3


def test_compile_outside_autoep_compiles_only_what_is_still_eager(monkeypatch):
    """After DeepSpeed's compile.autoep_non_moe compiled the layers that hold an AutoEP block, the rest (here layer 1)
    and every block's shared experts are compiled, once: a second call finds nothing left. [fails if: modules
    already compiled are compiled again]"""
    import deepspeed.module_inject.auto_ep_layer as auto_ep

    monkeypatch.setattr(auto_ep, "AutoEPMoELayer", Block)
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: fn)
    model = FakeModel(2, moe=True)
    model.layers[0].compile()  # as DeepSpeed did
    assert pretrain.compile_outside_autoep(model) == ["layers.1", "layers.0.mlp.shared_experts",
                                                      "layers.1.mlp.shared_experts"]
    assert pretrain.compile_outside_autoep(model) == []


def test_a_load_universal_in_the_users_ds_config_converts_nothing_without_resume(tmp_path, monkeypatch):
    """A DS config that sets checkpoint.load_universal itself, on a fresh run (no --resume): there is no `latest` to
    convert, and preflight converts nothing. [fails if: the conversion runs without --resume]"""
    from conftest import write_ds

    converted = []
    monkeypatch.setattr(engine.checkpoint, "to_universal", converted.append)
    ds = write_ds(tmp_path / "ds.json", checkpoint={"load_universal": True})
    _, cfg, _ = preflight_on(tmp_path, World(0, 1, 1), ds=ds)
    assert cfg["checkpoint"]["load_universal"] is True and converted == []


@pytest.mark.parametrize("error, rc, lines", [
    (ConfigError("row 7 is not text"), 2, ["error: row 7 is not text"]),
    (pretrain.DataStop(ConfigError("row 9 is not text"), 3), 1,
     ["error: row 9 is not text (reading the data of step 3)"]),
    (pretrain.DataStop(None, 3), 1, []),
])
def test_main_exits_2_for_bad_input_and_1_for_a_data_stop(tmp_path, monkeypatch, error, rc, lines):
    """main(): a ConfigError while building or training (bad data past preflight's sample) is exit 2 and its line; a
    DataStop exit 1, with a line only from the ranks that could not read (error set). [fails if: the exit codes are
    swapped, or a rank that read its data prints "error: None"]"""
    from conftest import ZERO3

    seen = []
    monkeypatch.setattr(pretrain, "start_ranks", lambda world, problem: problem is None)
    monkeypatch.setattr(pretrain, "print_error", seen.append)
    monkeypatch.setattr(pretrain, "build", lambda *a: (None, None))

    def train(*a):
        raise error

    monkeypatch.setattr(pretrain, "train", train)
    assert pretrain.main(["--deepspeed_config", str(ZERO3), "--run_dir", str(tmp_path / "run")]) == rc
    assert seen == lines


def test_main_ends_0_with_or_without_rows(tmp_path, monkeypatch):
    """A run resumed at train.max_steps trains nothing (no rows): exit 0 and no "done" line; a run with rows says the
    last step and loss. [fails if: main reads the last row of an empty list]"""
    from conftest import ZERO3

    printed = []
    monkeypatch.setattr(pretrain, "start_ranks", lambda world, problem: problem is None)
    monkeypatch.setattr(pretrain, "print0", printed.append)
    monkeypatch.setattr(pretrain, "build", lambda *a: (None, None))
    argv = ["--deepspeed_config", str(ZERO3), "--run_dir", str(tmp_path / "run")]
    for rows in ([], [{"step": 4, "loss": 2.5}]):
        monkeypatch.setattr(pretrain, "train", lambda *a, rows=rows: rows)
        assert pretrain.main(argv) == 0
    done = [p for p in printed if p.startswith("done")]
    assert done == [f"done: 4 steps, final loss 2.5000, run_dir {tmp_path / 'run'}"]


AUTO_COMPILE = {  # shipped file -> what "auto" compiles on CUDA with AutoEP, and without (bin/bench.py --no_autoep)
    "zero3.json": ("layers", "parameter-free"), "zero3_bf16_states.json": ("layers", "parameter-free"),
    "zero3_offload.json": ("layers", "parameter-free"),  # the optimizer offloaded; the layers are leaves still
    "zero2.json": ("deepspeed", "none"), "zero2_bf16_states.json": ("deepspeed", "none")}


@pytest.mark.parametrize("name", list(AUTO_COMPILE))
@pytest.mark.parametrize("autoep", [True, False])
def test_auto_compile_on_cuda_is_whole_layers_wherever_they_can_be(monkeypatch, name, autoep):
    """Pretraining's train.compile "auto" on CUDA, per shipped file: ZeRO-1/2 through DeepSpeed around AutoEP, ZeRO-3
    with AutoEP and decoder-layer leaves each layer in the engine (compile_layers); without AutoEP (bin/bench.py
    --no_autoep) no whole layer (ZeRO-3: the parameter-free functions). The memory model follows the same choice.
    [fails if: "auto" under zero3.json stays on the parameter-free functions, compiles a plain HF MoE layer, or
    auto_batch's calibration disagrees with what is compiled]"""
    from pathlib import Path
    from types import SimpleNamespace

    from engine import auto_batch, parallel
    from engine.auto_batch import AutoBatch
    from engine.ds_config import read_ds_config, resolve_ds_config, zero3_compiles_layers

    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    r = load_recipe(None, {"train.compile": "auto"})
    raw = read_ds_config(Path(__file__).parents[1] / "ds_configs" / name)
    if not autoep:
        raw.pop("expert_parallel")
    ds = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch(), device="cuda")
    whole = pretrain.wants_compile(r, ds)
    how = ("parameter-free" if parallel.compiles_parameter_free(ds, r.train) else
           ("layers" if zero3_compiles_layers(ds) else "deepspeed") if whole else "none")
    assert how == AUTO_COMPILE[name][0 if autoep else 1]
    assert (auto_batch.family(ds, r, "cuda") == "autoep_compiled") is (autoep and whole)
    # true as written keeps its meaning, false compiles nothing; GRPO's policy ("auto", lengths vary) compiles its
    # layers under ZeRO-3 with AutoEP (ds_config.grpo_compiles_layers), the parameter-free functions elsewhere
    assert pretrain.wants_compile(load_recipe(None, {"train.compile": True}), ds)
    assert not pretrain.wants_compile(load_recipe(None, {"train.compile": False}), ds)
    grpo_layers = autoep and name.startswith("zero3")
    assert parallel.compiles_parameter_free(ds, r.train, lengths_vary=True) is not grpo_layers


def test_auto_compile_leaves_linear_attention_eager_so_the_compile_does_not_grow_with_the_sequence():
    """Qwen3.5's Gated DeltaNet runs a Python loop over 64-token chunks that dynamo unrolls: the traced graph grows
    with the sequence. eager_linear_attention keeps those mixers out of the compiled layer (3 of the 4 layers of the
    tiny recipe's layout; the full-attention layer's untouched), so what is traced is the same at 128 and 256
    tokens, and the output does not change. [fails if: the mixers are left to the compiler, or a full-attention layer
    or an already-eager mixer is counted]"""
    from torch._dynamo.testing import CompileCounter
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                               num_experts=4, num_experts_per_tok=2, vocab_size=64)
    model = Qwen3_5MoeForCausalLM(cfg).eval()

    def traced_ops(seq):  # the first (linear-attention) layer, compiled as the engine compiles a layer's forward
        torch._dynamo.reset()
        counter, layer = CompileCounter(), model.model.layers[0]
        hidden = torch.randn(1, seq, 32)
        with torch.no_grad():
            out = torch.compile(layer.forward, backend=counter, dynamic=False)(hidden, position_embeddings=None)
            assert torch.allclose(out, layer(hidden, position_embeddings=None), atol=1e-6)
        return counter.op_count

    grows = traced_ops(192) - traced_ops(128)
    assert grows > 0  # the unrolled chunk loop
    assert pretrain.eager_linear_attention(model) == 3
    assert [getattr(layer.linear_attn.forward, "_torchdynamo_disable", False) for layer in model.model.layers[:3]] \
        == [True] * 3 and not hasattr(model.model.layers[3], "linear_attn")
    assert traced_ops(192) == traced_ops(128)
    assert pretrain.eager_linear_attention(model) == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("name, compile_, device, written, expect", [
    ("zero3.json", "auto", "cuda", None, False),  # "auto" on CUDA compiles each layer: torch's own linear
    ("zero3.json", True, "cpu", None, False),  # true compiles them anywhere
    ("zero3.json", True, "cuda", True, True),  # a value in the file is kept
    ("zero3.json", "auto", "cpu", None, None),  # nothing compiled on a CPU with "auto": DeepSpeed's default
    ("zero3.json", False, "cuda", None, None),
    ("zero3_offload.json", "auto", "cuda", None, False),  # the optimizer offloaded, the layers compiled still
    ("zero2.json", True, "cuda", None, None),  # DeepSpeed's linear exists under ZeRO-3 only
])
def test_zero3_layer_compile_builds_with_torchs_linear_unless_the_file_says(monkeypatch, name, compile_, device,
                                                                            written, expect):
    """Where pretraining compiles each decoder layer under ZeRO-3, zero.Init is told to leave torch's linear alone
    (memory_efficient_linear false): DeepSpeed's made dynamo trace every layer on its own (docs/benchmarks.md).
    Elsewhere the DS config keeps DeepSpeed's default. [fails if: the value is not filled in where the layers are
    compiled, is filled in where they are not, or overrides the file's]"""
    from pathlib import Path
    from types import SimpleNamespace

    from engine.auto_batch import AutoBatch
    from engine.ds_config import read_ds_config, resolve_ds_config, zero3_compiles_layers

    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: device))
    r = load_recipe(None, {"train.compile": compile_})
    raw = read_ds_config(Path(__file__).parents[1] / "ds_configs" / name)
    if written is not None:
        raw["zero_optimization"]["memory_efficient_linear"] = written
    ds = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch(), device=device)
    pretrain.plain_linear_for_compiled_layers(ds, pretrain.wants_compile(r, ds))
    assert ds["zero_optimization"].get("memory_efficient_linear") is expect
    if expect is False:
        assert zero3_compiles_layers(ds)


@pytest.mark.parametrize("written, plain", [(None, True), (False, True), (True, False)])
def test_torchs_linear_comes_back_where_an_earlier_build_patched_deepspeeds_in(monkeypatch, written, plain):
    """zero.Init patches DeepSpeed's linear into torch.nn.functional for the whole process and never takes it out
    when a later config says memory_efficient_linear false: a rank that runs a second job (the suite's rank pool) built
    its compiled layers with DeepSpeed's linear. The fill puts torch's back wherever the value ends up false (filled
    or written), and leaves DeepSpeed's where the file asks for it. [fails if: the earlier patch is left in place under
    a false value, or torch's is put back under a true one]"""
    from pathlib import Path

    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    from engine.auto_batch import AutoBatch
    from engine.ds_config import read_ds_config, resolve_ds_config

    torchs = getattr(Init, "linear_bk", F.linear)  # another test's zero.Init may have patched it already
    # what an earlier zero.Init with the default (true) did (Init._enable_mem_efficient_linear)
    monkeypatch.setattr(Init, "linear_bk", torchs, raising=False)
    monkeypatch.setattr(F, "linear", zero3_linear_wrap)
    r = load_recipe(None, {"train.compile": True})
    raw = read_ds_config(Path(__file__).parents[1] / "ds_configs" / "zero3.json")
    if written is not None:
        raw["zero_optimization"]["memory_efficient_linear"] = written
    ds = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch(), device="cpu")
    pretrain.plain_linear_for_compiled_layers(ds, True)
    assert (F.linear is torchs) is plain and (F.linear is zero3_linear_wrap) is not plain
