"""Pipeline-parallel mode (ds_configs/pipe.json, issue 6) on 2 CPU ranks (conftest.run_ranks: the rank pool), 2 stages.

- the same model, seed and global batch give the ZeRO-3 path's losses (and expert loads) over 5 steps;
- each rank holds only its stage's layers;
- resuming from a pipeline checkpoint continues with the uninterrupted run's losses;
- bin/zero_to_fp32 turns a pipeline checkpoint (DeepSeek-V3 and Qwen3-MoE) into the Hugging Face layout of
  ZeRO-3 exports, whose logits are the pipeline engine's;
- bad pipeline configs stop before any work with one line and exit 2; bin/bench.py accepts pipe.json.

fp32 (the shipped bf16 dropped), so differences are summation order only. Measured on this 2-core CPU: losses
bitwise equal to ZeRO-3's (ZeRO-3 with expert parallel 2, the pipeline with expert parallel 1 per stage),
exported logits within 1e-6 of the engine's.

The runs: the pipeline's job is tests/scripts/pretrain_logits.py (bin/pretrain.py, then the trained pipeline
engine's logits); the ZeRO-3 run it must equal is conftest's deepseek_2ranks, shared with tests/test_export.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (ROOT, SMALL_DEEPSEEK, finished, fixed_ids, pretrain_job, read_metrics, run_in_process, run_ranks,
                      small_corpus, write_ds)
from test_export import QWEN  # the same Qwen3 model as the ZeRO-3 export tests

sys.path.insert(0, str(ROOT))
PRETRAIN = ROOT / "bin" / "pretrain.py"
PIPE = ROOT / "ds_configs" / "pipe.json"
LOSS_TOL = 1e-5    # |pipeline - ZeRO-3| per logged step, fp32 (measured: 0)
LOGIT_TOL = 1e-5   # |exported HF model - pipeline engine| (measured: < 1e-6)

# Three layers: stage 0 = embedding + dense layer 0 + MoE layer 1, stage 1 = MoE layer 2 + norm/head.
# balance_rate > 0 moves the routing biases, so their per-stage all-reduce and their export are exercised too.
RECIPE = SMALL_DEEPSEEK  # the run the pipeline must equal is conftest's deepseek_2ranks, on this recipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deepseek_2ranks):
    """The same recipe, seed and global batch (4 sequences) as a 2-stage pipeline and as ZeRO-3, on 2 ranks; the ZeRO-3
    run is conftest's deepseek_2ranks (shared with tests/test_export.py). The pipeline launch also saves its trained
    engine's logits for conftest.fixed_ids() (tests/scripts/pretrain_logits.py)."""
    tmp = tmp_path_factory.mktemp("pipeline")
    # pipeline: 2 stages x data-parallel 1, 2 micro-batches of 2; ZeRO-3: 2 ranks x 1 micro-batch of 2
    pipe = write_ds(tmp / "pipe.json", base=PIPE, drop=("bf16",), train_micro_batch_size_per_gpu=2,
                    gradient_accumulation_steps=2)
    job, run = pretrain_job(tmp, RECIPE, 2, pipe, corpus=small_corpus(tmp / "corpus.jsonl"), run_name="pipe")
    run_ranks(*job, cwd=tmp)
    finished(run)
    common = ["--config", tmp / "recipe.yaml", "--data", tmp / "corpus.jsonl"]
    return {"dir": tmp, "pipe_ds": pipe, "common": common, "zero3": deepseek_2ranks["run"],
            "probe": {"run": tmp / "pipe", "logits": run["logits"], "params": run["params"]}}


def test_losses_match_zero3(runs):
    pipe, zero3 = read_metrics(runs["dir"] / "pipe"), read_metrics(runs["zero3"])
    assert [r["step"] for r in pipe] == [r["step"] for r in zero3] == [1, 2, 3, 4, 5]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(pipe, zero3))
    print(f"\nmax |loss pipeline - loss ZeRO-3| over 5 steps: {diff:.3g}; "
          f"losses {[round(r['loss'], 6) for r in pipe]}")
    assert diff <= LOSS_TOL
    assert pipe[-1]["loss"] < pipe[0]["loss"] - 0.2  # it trains
    # every MoE layer's load, summed over the ranks that hold it, logged on rank 0 (stage 0 holds only one)
    assert [r["expert_load_max_over_mean"] for r in pipe] == [r["expert_load_max_over_mean"] for r in zero3]
    assert all(len(r["expert_load_max_over_mean"]) == 2 for r in pipe)


def test_each_stage_holds_only_its_layers(runs):
    tag = runs["dir"] / "pipe" / "checkpoints" / "step_00000005"
    stage0 = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    stage1 = torch.load(tag / "mp_rank_01_model_states.pt", weights_only=False)["module"]
    assert {k.split(".")[0] for k in stage0} == {"0", "1", "2"}  # embedding, layers 0 and 1
    assert {k.split(".")[0] for k in stage1} == {"3", "4"}       # layer 2, norm + head
    assert sorted(p.name for p in tag.glob("layer_*_expert_*")) == sorted(  # each stage's own MoE layer's experts
        f"layer_0_expert_{e}_mp_rank_{s:02d}_model_states.pt" for e in range(4) for s in range(2))


def test_resume_continues_like_the_uninterrupted_run(runs, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(runs["dir"] / "pipe", run)
    shutil.rmtree(run / "checkpoints" / "step_00000005")
    (run / "checkpoints" / "latest").write_text("step_00000003")
    rows = read_metrics(run)[:3]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_ranks(2, PRETRAIN, "--deepspeed_config", runs["pipe_ds"], "--run_dir", run, "--resume", *runs["common"],
              cwd=tmp_path)
    resumed, straight = read_metrics(run)[3:], read_metrics(runs["dir"] / "pipe")[3:]
    assert [r["step"] for r in resumed] == [4, 5]
    for a, b in zip(resumed, straight):  # CPU: bitwise, as ZeRO-3 resumes (tests/test_resume.py)
        assert (a["loss"], a["expert_load_max_over_mean"]) == (b["loss"], b["expert_load_max_over_mean"])


@pytest.fixture(scope="module")
def deepseek_probe(runs):
    """The pipeline engine's logits for fixed ids after its last step (= its last checkpoint), each rank's parameter
    count."""
    return runs["probe"]


@pytest.fixture(scope="module")
def qwen_probe(runs):
    """Qwen3-MoE through the same path (AutoEP's Qwen3 layer also exposes its router as `mlp.gate`)."""
    job, run = pretrain_job(runs["dir"] / "qwen", QWEN, 2, runs["pipe_ds"], corpus=runs["dir"] / "corpus.jsonl")
    run_ranks(*job, cwd=runs["dir"] / "qwen")
    return finished(run)


def zero_to_fp32(*args) -> subprocess.CompletedProcess:
    """`bin/zero_to_fp32 ARGS` (conftest.run_ranks: in this process)."""
    return run_ranks(1, ROOT / "bin" / "zero_to_fp32", *args, cwd=ROOT, check=False)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_export_gives_the_engines_logits(arch, request, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = request.getfixturevalue("deepseek_probe" if arch == "deepseek_v3" else "qwen_probe")
    out = tmp_path / "hf"
    p = zero_to_fp32(engine["run"], out)
    assert p.returncode == 0, p.stdout + p.stderr
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=fixed_ids()).logits
    diff = (logits - engine["logits"]).abs().max().item()
    print(f"\n{arch}: max |logits exported HF model - pipeline engine| = {diff:.3g}")
    assert logits.shape == engine["logits"].shape and diff <= LOGIT_TOL

    # No rank holds another stage's layers: the ranks' parameters add up to the model's, each rank's to less.
    with torch.device("meta"):
        total = sum(t.numel() for t in AutoModelForCausalLM.from_config(model.config).parameters())
    assert sum(engine["params"]) == total and max(engine["params"]) < total


def test_export_has_the_layout_of_a_zero3_export(runs, tmp_path):
    from safetensors.torch import load_file

    out, ref = tmp_path / "hf", tmp_path / "hf_zero3"
    for run, dest in ((runs["dir"] / "pipe", out), (runs["zero3"], ref)):
        p = zero_to_fp32(run, dest)
        assert p.returncode == 0, p.stdout + p.stderr

    # The same layout as a ZeRO-3 export (keys, shapes, dtypes); after 5 identical-loss steps, nearly the same values.
    ours = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    theirs = {k: v for f in ref.glob("*.safetensors") for k, v in load_file(f).items()}
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-4
    assert ours["model.layers.2.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # stage 1's routing bias moved


def test_export_refuses_a_checkpoint_missing_an_expert_file(runs, tmp_path):
    tag = tmp_path / "copy"
    shutil.copytree(runs["dir"] / "pipe" / "checkpoints" / "step_00000005", tag)
    (tag / "layer_0_expert_2_mp_rank_01_model_states.pt").unlink()
    p = zero_to_fp32(tag, tmp_path / "out")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    assert "layer_0_expert_2_mp_rank_01_model_states.pt is missing" in lines[0]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------- bad input

BAD = {  # case: (world size, changes to pipe.json, what the line must say); the embedded 2-layer recipe
    "more_stages_than_layers": (3, {"pipeline": {"stages": 3}},
                                ["pipeline.stages (3) is more than model.num_layers (2)", "at most 2 stages"]),
    "zero3_with_pipeline": (2, {"zero_optimization": {"stage": 3}},
                            ["zero_optimization.stage (3) cannot be combined with a pipeline", "stage 1"]),
    "micro_batches_do_not_divide_the_batch": (2, {"train_batch_size": 6},
                                              ["train_batch_size (6) != train_micro_batch_size_per_gpu (4)",
                                               "gradient_accumulation_steps (4 micro-batches in the pipeline)",
                                               "data-parallel size (1 = 2 ranks / 2 stages) = 16"]),
    "stages_do_not_divide_the_world": (3, {}, ["pipeline.stages (2) must divide the world size (3)"]),
    "experts_across_stages": (2, {"expert_parallel": {"enabled": True, "autoep_size": 2,
                                                      "moe_layer_pattern": "\\d+\\.layer\\.mlp"}},
                              ["expert_parallel.autoep_size (2) must divide the ranks per pipeline stage",
                               "experts cannot span pipeline stages"]),
    "zero0_with_pipeline": (2, {"zero_optimization": {"stage": 0}},  # stage 0 clips on the first stage's norm only
                            ["zero_optimization.stage (0) cannot be combined with a pipeline", "set stage 1"]),
    "partition_regex_invalid": (2, {"pipeline": {"stages": 2, "partition": "type:["}},
                                ["pipeline.partition ('type:[') is not a valid regular expression"]),
    "partition_matches_no_layer": (2, {"pipeline": {"stages": 2, "partition": "type:Nothing"}},
                                   ["pipeline.partition ('type:Nothing') matches none of the pipeline's layer classes"]),
    "stage_without_moe_layer": (2, {"pipeline": {"stages": 2, "partition": "type:head"}},
                                ["pipeline: stage 1 of 2 would hold no MoE layer (the head only",
                                 "AutoEP needs one on every stage"]),
    "autoep_pattern_missing": (2, {"expert_parallel": {"enabled": True, "autoep_size": "auto"}},
                               ["expert_parallel.moe_layer_pattern (None)", '"\\\\d+\\\\.layer\\\\.mlp"']),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_pipeline_config_is_one_line_and_exit_2(tmp_path, case, capfd, monkeypatch):
    """bin/pretrain.py's main in this process as rank 0 of `world` (conftest.run_in_process; the fresh-process
    check of the same path is tests/test_pretrain.py's test_bad_input_from_the_command_line_is_all_it_prints)."""
    from engine.pretrain import main

    world, changes, expect = BAD[case]
    ds = write_ds(tmp_path / "ds.json", base=PIPE, **changes)
    p = run_in_process(main, ["--deepspeed_config", ds, "--run_dir", tmp_path / "run"], capfd, monkeypatch,
                       cwd=tmp_path, RANK=0, LOCAL_RANK=0, WORLD_SIZE=world, LOCAL_SIZE=world)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-2000:]
    for text in expect:
        assert text in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_stage_layout_is_deepspeeds_and_every_stage_needs_an_moe_layer():
    """The preflight's layout equals the PipelineModule's own partition (the rank's bounds come from it), and a
    stage holding only dense-first layers is refused with the largest stage count that works (AutoEP raised on
    every rank of such a stage before)."""
    from types import SimpleNamespace

    from engine.ds_config import PARTITION, check_stage_layout, stage_layout

    assert stage_layout(PARTITION, 2, 3) == [(0, 3), (3, 5)]  # the 3-layer test model above: layers 0-1 | 2 + head
    assert stage_layout("uniform", 3, 3) == [(0, 2), (2, 4), (4, 5)]
    recipe = SimpleNamespace(model=SimpleNamespace(num_layers=12, first_dense_layers=1))
    assert check_stage_layout(PARTITION, 11, recipe, True) == []
    [line] = check_stage_layout(PARTITION, 12, recipe, True)
    assert line.startswith("pipeline: stage 0 of 12 would hold no MoE layer (dense decoder layer 0, ") and \
        "use at most 11 stages" in line, line
    assert check_stage_layout(PARTITION, 12, recipe, False) == []  # without AutoEP a dense stage is fine


@pytest.mark.parametrize("other", ["zero3", "world"])
def test_resume_refuses_another_mode_or_world(runs, tmp_path, other, capfd, monkeypatch):
    """A pipeline checkpoint resumed as ZeRO-3, or on another world size: one line, exit 2, checkpoint untouched.
    bin/pretrain.py's main in this process as rank 0 (conftest.run_in_process)."""
    from engine.pretrain import main

    ds = write_ds(tmp_path / "zero3.json", drop=("bf16",)) if other == "zero3" else runs["pipe_ds"]
    world = 2 if other == "zero3" else 4
    argv = ["--deepspeed_config", ds, "--run_dir", runs["dir"] / "pipe", "--resume", *runs["common"]]
    before = sorted((runs["dir"] / "pipe" / "checkpoints").rglob("*"))
    p = run_in_process(main, argv, capfd, monkeypatch, cwd=tmp_path, RANK=0, LOCAL_RANK=0, WORLD_SIZE=world,
                       LOCAL_SIZE=world)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --resume: "), p.stderr[-2000:]
    assert ("saved with 2 pipeline stages, the DeepSpeed config has no pipeline" if other == "zero3"
            else "pipeline mode resumes only on the same world size") in lines[0]
    assert sorted((runs["dir"] / "pipe" / "checkpoints").rglob("*")) == before


# ----------------------------------------------------------------------------------------------- bench


def test_bench_accepts_the_pipeline_config(tmp_path):
    """bin/bench.py with pipe.json as shipped (bf16) on 2 ranks, on Qwen3-MoE (the other architecture)."""
    from transformers import AutoModelForCausalLM

    from engine.config import RECIPES, load_recipe
    from engine.data import load_tokenizer
    from engine.model import make_hf_config

    out = tmp_path / "bench.jsonl"
    recipe = RECIPES / "tiny_qwen3.yaml"
    p = run_ranks(2, ROOT / "bin" / "bench.py", "--deepspeed_config", PIPE, "--config", recipe, "--steps", "2",
                  "--warmup", "1", "--out", out, cwd=tmp_path)
    row = json.loads(out.read_text())
    assert (row["world"], row["stages"], row["ds_config"]) == (2, 2, "pipe.json")
    r = load_recipe(recipe)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(make_hf_config(r.model, load_tokenizer(r.data.tokenizer)))
    assert row["params_m"] == round(sum(t.numel() for t in hf.parameters()) / 1e6, 3)  # both stages counted
    assert row["tokens_per_s_per_gpu"] > 0 and 0 < row["mfu"] < 1 and row["loss"] > 0
    assert "tokens_per_s_per_gpu" in p.stdout  # the table
