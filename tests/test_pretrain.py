"""One process, 1 CPU rank: the embedded default trains; bad input stops before any work with one clear line."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, ZERO3, env, read_metrics, run_in_process, run_ranks, write_ds

from engine.config import RECIPES, ConfigError, load_recipe
from engine.auto_batch import AutoBatch
from engine.ds_config import PIPELINE_ARCHS, auto_autoep_size, read_ds_config, resolve_ds_config

PRETRAIN = ROOT / "bin" / "pretrain.py"


def test_default_recipe_runs_in_this_process(tmp_path, capfd):
    """The embedded default recipe, 1 rank, in the pytest process itself (no launcher: a plain `python
    bin/pretrain.py` is a world of one). zero3.json's "auto" batch sizes are 8 x 1 on the CPU (as the file said
    before "auto"), printed once and recorded in the checkpoint; ZeRO-3 sees every tensor the model returns (no
    warning that its backward hooks may not fire). That the default trains (40 steps, the loss falls by more than
    1.0) is checked through the launcher, on the README's command: test_readme.py."""
    from deepspeed.runtime.zero import utils as zero_utils

    from engine.pretrain import main

    run = tmp_path / "run"
    zero_utils.warned = False  # DeepSpeed warns once per process
    assert main(["--deepspeed_config", str(ZERO3), "--max_steps", "3", "--run_dir", str(run)]) == 0
    out, err = capfd.readouterr()
    assert out.count('batch: micro-batch 8 x 1 accumulation per GPU ("auto": ') == 1
    assert "unknown inputs or outputs type" not in out + err
    saved = json.loads((run / "checkpoints" / "step_00000003" / "engine_state.json").read_text())
    assert (saved["micro_batch"], saved["grad_accum"]) == (8, 1)
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003"
    # transformers' global DeepSpeed config is dropped on return: a model built later in this process (another
    # test's) is not built under zero.Init with empty partitions (test_bench.py's saved initial model once was)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
@pytest.mark.parametrize("ds", sorted((ROOT / "ds_configs").glob("*.json")), ids=lambda p: p.name)
@pytest.mark.parametrize("world", [1, 2, 16])
def test_every_shipped_config_resolves(recipe, ds, world):
    r = load_recipe(recipe)
    stages = read_ds_config(ds).get("pipeline", {}).get("stages", 1)
    if world % stages:
        with pytest.raises(ConfigError, match=rf"pipeline.stages \({stages}\) must divide the world size \({world}\)"):
            resolve_ds_config(read_ds_config(ds), r, world_size=world, ranks_per_node=min(world, 8),
                              auto_batch=AutoBatch())
        return  # a pipeline needs a rank per stage
    if stages > 1 and r.model.arch not in PIPELINE_ARCHS:
        with pytest.raises(ConfigError, match=rf"model.arch {r.model.arch}: pipeline mode builds its stages for "):
            resolve_ds_config(read_ds_config(ds), r, world_size=world, ranks_per_node=min(world, 8),
                              auto_batch=AutoBatch())
        return  # refused in one line (tests/test_families.py)
    cfg = resolve_ds_config(read_ds_config(ds), r, world_size=world, ranks_per_node=min(world, 8),
                            auto_batch=AutoBatch())  # the CPU: "auto" batch sizes are 8 x 1
    ep, dp = cfg["expert_parallel"]["autoep_size"], world // stages  # experts stay inside a pipeline stage
    assert r.model.num_experts % ep == 0 and dp % ep == 0
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    assert read_ds_config(ds)["expert_parallel"]["autoep_size"] == "auto"  # the file itself is untouched
    assert "auto" not in cfg.get("zero_optimization", {}).values()  # DeepSpeed would take its defaults silently


@pytest.mark.parametrize("world, device, offload, written, expect", [
    (1, "cuda", None, None, (10**10, 10**10, 5 * 10**8)),  # one GPU: a gather is a view of its own partition
    (2, "cuda", None, None, (10**9, 10**9, 5 * 10**7)),  # several: DeepSpeed's defaults (each would hold the model)
    (16, "cuda", None, None, (10**9, 10**9, 5 * 10**7)),
    (1, "cuda", "cpu", None, (10**9, 10**9, 5 * 10**7)),  # offloaded parameters would all stay on the GPU
    (1, "cuda", "none", None, (10**10, 10**10, 5 * 10**8)),
    (1, "cuda", None, 123, (123, 10**10, 5 * 10**8)),  # a number in the file is kept
    (1, "cpu", None, None, (10**9, 10**9, 5 * 10**7)),  # CPU ranks: measured slower with the single-rank values
])
def test_zero3_gather_settings_auto_keep_gathered_parameters_on_one_gpu_only(world, device, offload, written, expect):
    from engine.ds_config import ZERO3_GATHER

    raw = read_ds_config(ZERO3)
    z = raw["zero_optimization"]
    assert all(z[k] == "auto" for k in ZERO3_GATHER)  # as shipped
    if offload:
        z["offload_param"] = {"device": offload}
    if written is not None:
        z["stage3_max_live_parameters"] = written
    cfg = resolve_ds_config(raw, load_recipe(None), world_size=world, ranks_per_node=min(world, 8), device=device,
                            auto_batch=AutoBatch(memory_gib=80.0))
    assert tuple(cfg["zero_optimization"][k] for k in ZERO3_GATHER) == expect


@pytest.mark.parametrize("stage, written, expect", [
    (3, "auto", {"names": [f"model.layers.{i}" for i in range(2)], "classes": [], "name_suffixes": []}),
    (2, "auto", None),  # below ZeRO-3 there are no hooks to spare: the key is dropped
    (3, {"classes": ["DeepseekV3MLP"]}, {"classes": ["DeepseekV3MLP"]}),  # written: as written
    (3, "layers", ConfigError),
    (3, None, None),  # null: no leaves, DeepSpeed's hook on every module
])
def test_leaf_module_auto_names_the_decoder_layers_under_zero3(stage, written, expect):
    raw = read_ds_config(ZERO3)
    assert raw["zero_optimization"]["leaf_module"] == "auto"  # as shipped
    raw["zero_optimization"].update(stage=stage, leaf_module=written)
    if expect is ConfigError:
        with pytest.raises(ConfigError, match=r"zero_optimization.leaf_module \('layers'\) must be \"auto\" "):
            resolve_ds_config(raw, load_recipe(None), world_size=1, ranks_per_node=1, auto_batch=AutoBatch())
        return
    cfg = resolve_ds_config(raw, load_recipe(None, {"model.num_layers": 2}), world_size=1, ranks_per_node=1,
                            auto_batch=AutoBatch())
    assert cfg["zero_optimization"].get("leaf_module") == expect


def test_leaf_module_names_missing_from_the_model_are_refused():
    """DeepSpeed only logs a warning for a leaf name it does not find, then hooks that module's insides one by one."""
    from transformers import AutoModelForCausalLM

    from engine.config import ConfigError
    from engine.model import make_hf_config
    from engine.parallel import check_leaf_modules

    model = AutoModelForCausalLM.from_config(make_hf_config(load_recipe(None, {"model.num_layers": 2}).model))
    ok = {"zero_optimization": {"leaf_module": {"names": ["model.layers.0", "model.layers.1"]}}}
    check_leaf_modules(ok, model)
    with pytest.raises(ConfigError, match=r"leaf_module.names: no module named model.layers.2 in this "):
        check_leaf_modules({"zero_optimization": {"leaf_module": {"names": ["model.layers.2"]}}}, model)


@pytest.mark.parametrize("ds, device, written, expect", [
    ("zero3.json", "cpu", None, True),  # CPU ranks: torch's AdamW, no FusedAdam build
    ("zero2.json", "cpu", None, True),
    ("zero3.json", "cpu", False, False),  # a value in the file is kept
    ("zero3_offload.json", "cpu", None, None),  # offloaded states keep DeepSpeedCPUAdam
    ("zero3.json", "cuda", None, None),  # GPUs keep FusedAdam
])
def test_cpu_ranks_take_torch_adamw_unless_offloaded_or_written(ds, device, written, expect):
    raw = read_ds_config(ROOT / "ds_configs" / ds)
    if written is not None:
        raw["optimizer"]["params"]["torch_adam"] = written
    cfg = resolve_ds_config(raw, load_recipe(None), world_size=1, ranks_per_node=1, device=device,
                            auto_batch=AutoBatch(memory_gib=80.0))  # memory given: no device is asked
    assert cfg["optimizer"]["params"].get("torch_adam") == expect
    assert "torch_adam" not in read_ds_config(ROOT / "ds_configs" / ds)["optimizer"]["params"]  # file untouched


def test_zenflow_is_refused_before_any_rank_starts():
    """DeepSpeed 0.19.8's ZenFlow hands the engine's model back from deepspeed.initialize with its matrices' values
    reordered (found on CPU ranks: same parameter sums, another order; the first loss differs, the second is NaN), so
    a DS config asking for it is refused in the config check, with the configs to use instead."""
    raw = read_ds_config(ROOT / "ds_configs" / "zero2.json")
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    raw["zero_optimization"]["zenflow"] = {"topk_ratio": 0.05, "update_interval": 4}
    with pytest.raises(ConfigError, match=r"zero_optimization.zenflow: not supported.*zero3_offload.json"):
        resolve_ds_config(raw, load_recipe(None), world_size=1, ranks_per_node=1, device="cpu",
                          auto_batch=AutoBatch(memory_gib=80.0))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_partial_offload_ratio_needs_zero3(stage):
    """offload_optimizer.ratio < 1 is DeepSpeed's partial offload, ZeRO-3 only: under ZeRO-1/2 DeepSpeed stops with a
    pydantic traceback inside deepspeed.initialize; the config check says it in one line first."""
    raw = read_ds_config(ROOT / "ds_configs" / "zero3_offload.json")
    raw["zero_optimization"]["stage"] = stage
    kw = dict(world_size=1, ranks_per_node=1, device="cpu", auto_batch=AutoBatch(memory_gib=80.0))
    if stage == 3:
        assert resolve_ds_config(raw, load_recipe(None), **kw)["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
        return
    with pytest.raises(ConfigError, match=r"offload_optimizer.ratio \(0.5\): DeepSpeed offloads part of the optimizer "
                                          r"under ZeRO-3 only .*; remove ratio, or use ds_configs/zero3_offload.json"):
        resolve_ds_config(raw, load_recipe(None), **kw)


def test_quick_cpu_info_gives_deepspeed_the_same_op_flags_as_py_cpuinfo(monkeypatch):
    """engine/parallel.py quick_cpu_info answers DeepSpeed's CPU-op probe from /proc/cpuinfo: the compiler flags of
    each CPU op (so the build it loads) and CPUAdam's vendor must equal what py-cpuinfo gives."""
    import platform

    import cpuinfo
    from deepspeed.accelerator import get_accelerator

    from engine.parallel import quick_cpu_info

    if get_accelerator().device_name() != "cpu" or platform.machine() != "x86_64" or sys.platform != "linux":
        pytest.skip("quick_cpu_info only acts on x86-64 Linux CPU ranks")
    builders = [get_accelerator().create_op_builder(n) for n in ("FusedAdamBuilder", "CPUAdamBuilder")]
    real = cpuinfo.cpuinfo.get_cpu_info()  # py-cpuinfo's own, even where an earlier test installed quick_cpu_info
    before = [(b.cpu_arch(), b.simd_width(), b.cxx_args()) for b in builders]
    original = cpuinfo.get_cpu_info
    monkeypatch.setattr(cpuinfo, "get_cpu_info", original)  # restored after the test
    quick_cpu_info()
    assert cpuinfo.get_cpu_info is not original
    quick = cpuinfo.get_cpu_info()
    assert [(b.cpu_arch(), b.simd_width(), b.cxx_args()) for b in builders] == before
    assert quick["vendor_id_raw"] == real["vendor_id_raw"] and quick["arch"] == real["arch"]
    def names(flags):  # the kernel spells avx512_vnni, py-cpuinfo some of them avx512vnni
        return {f.replace("_", "") for f in flags}

    assert names(quick["flags"]) >= names(f for f in real["flags"] if f.startswith(("avx", "sve", "fma")))


def test_auto_autoep_size_stays_inside_a_node():
    assert auto_autoep_size(num_experts=64, world_size=16, ranks_per_node=8) == 8
    assert auto_autoep_size(num_experts=8, world_size=2, ranks_per_node=2) == 2
    assert auto_autoep_size(num_experts=6, world_size=4, ranks_per_node=4) == 2
    assert auto_autoep_size(num_experts=8, world_size=1, ranks_per_node=1) == 1


@pytest.mark.parametrize("stage, ds_sets, compile_, expect", [
    (2, {}, "auto", True),                      # the measured fast path: compile around the AutoEP blocks
    (2, {}, False, None),                       # off: the DS config is left alone
    (2, {"compile": {"autoep_non_moe": False}}, "auto", False),  # an explicit choice in the DS config stays
    (3, {}, "auto", None),                      # DeepSpeed cannot do it under ZeRO-3: auto stays off
    (3, {"leaf_module": "auto"}, True, None),   # the engine compiles the layers there (compile_layers)
    (2, {"offload_optimizer": {"device": "cpu"}}, "auto", None),
])
def test_compile_follows_what_deepspeed_can_do(stage, ds_sets, compile_, expect):
    from engine.pretrain import wants_compile

    r = load_recipe(None, {"train.compile": compile_})
    raw = read_ds_config(ROOT / "ds_configs" / "zero2.json")
    raw["zero_optimization"].update({"stage": stage, **{k: v for k, v in ds_sets.items() if k != "compile"}})
    raw.pop("compile", None)
    raw.update({k: v for k, v in ds_sets.items() if k == "compile"})
    cfg = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch())
    assert cfg.get("compile", {}).get("autoep_non_moe") is expect
    assert wants_compile(r, cfg) is (compile_ is True)  # auto compiles on CUDA devices only; this is a CPU


@pytest.mark.parametrize("device, written, expect", [
    ("cuda", None, "fused_weighted_sum"), ("cuda", "auto", "fused_weighted_sum"), ("cpu", None, "weighted_sum"),
    ("rocm", "auto", "weighted_sum"), ("cuda", "weighted_sum", "weighted_sum"), ("cpu", "legacy_bmm", "legacy_bmm")])
def test_moe_combine_kernel_follows_the_device_unless_written(device, written, expect):
    raw = read_ds_config(ROOT / "ds_configs" / "zero2.json")
    if written:
        raw["expert_parallel"]["combine_impl"] = written
    cfg = resolve_ds_config(raw, load_recipe(None), world_size=1, ranks_per_node=1, device=device,
                            auto_batch=AutoBatch())
    assert cfg["expert_parallel"]["combine_impl"] == expect
    assert raw["expert_parallel"].get("combine_impl") == written  # the caller's dict is not touched


def test_compiled_model_leaves_only_autoep_eager_and_matches_eager(tmp_path, capsys):
    """train.compile: true with ZeRO-2 + AutoEP, here on a CPU: DeepSpeed compiles the decoder layers that hold an
    AutoEP block; the engine compiles the rest (a first dense layer, each block's shared experts). The compiled
    model's loss equals the eager one's on the same batch (bf16: inductor fuses and reorders, 1e-2)."""
    import torch

    from engine.data import load_tokenizer
    from engine.parallel import init_distributed, world_from_env
    from engine.pretrain import build

    r = load_recipe(None, {"train.compile": True, "model.first_dense_layers": 1, "run_dir": str(tmp_path)})
    ds = resolve_ds_config(read_ds_config(ROOT / "ds_configs" / "zero2.json"), r, world_size=1, ranks_per_node=1,
                           auto_batch=AutoBatch())
    init_distributed()
    engine, data = build(r, ds, load_tokenizer(r.data.tokenizer), world_from_env())
    assert ("compile: the decoder layers around their AutoEP blocks (DeepSpeed; the blocks eager), and 2 more modules "
            "(dense layers, shared experts)") in capsys.readouterr().out  # layers.0 (dense) and layers.1's shared MLP
    layers = engine.module.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert layers[1].mlp.__class__.__name__ == "AutoEPMoELayer"
    assert layers[1].mlp.shared_experts._compiled_call_impl is not None
    ids = next(data.micro_batches(2, 0, 1))[1]
    torch._dynamo.utils.counters.clear()
    compiled = engine(input_ids=ids, labels=ids).loss.item()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3  # dense layer, MoE layer parts, shared MLP
    with torch.compiler.set_stance("force_eager"):
        eager = engine(input_ids=ids, labels=ids).loss.item()
    assert abs(compiled - eager) < 1e-2, (compiled, eager)


def test_zero3_compiled_layers_build_with_torchs_linear_and_match_eager(tmp_path, capsys, monkeypatch):
    """train.compile: true under zero3.json (each decoder layer compiled in the engine): the model is built with
    torch's own linear, not the one zero.Init patches in (pretrain.plain_linear_for_compiled_layers, filled in before
    the build), and the compiled loss and gradients' effect equal the eager ones on the same batch. [fails if: the
    setting is not filled in (DeepSpeed's linear patched in and left there), or the plain linear breaks ZeRO-3's
    backward. Filled in after the build it passes: the fill then puts torch's linear back before the first forward,
    which is the same model]"""
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    from engine.data import load_tokenizer
    from engine.parallel import init_distributed, world_from_env
    from engine.pretrain import build

    plain = getattr(Init, "linear_bk", F.linear)  # another test's zero.Init may have patched it: restored after
    monkeypatch.setattr(F, "linear", plain)
    r = load_recipe(None, {"train.compile": True, "model.num_layers": 3, "run_dir": str(tmp_path)})
    ds = resolve_ds_config(read_ds_config(ZERO3), r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch())
    init_distributed()
    engine, data = build(r, ds, load_tokenizer(r.data.tokenizer), world_from_env())
    assert "compile: each decoder layer's forward (3 layers" in capsys.readouterr().out
    assert F.linear is plain and ds["zero_optimization"]["memory_efficient_linear"] is False
    ids = next(data.micro_batches(2, 0, 1))[1]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)  # ZeRO-3 gathers each layer again for its backward: torch's linear needs no help
    engine.step()
    with torch.compiler.set_stance("force_eager"):
        eager = engine(input_ids=ids, labels=ids).loss.item()
    assert abs(engine(input_ids=ids, labels=ids).loss.item() - eager) < 1e-2
    assert eager < loss.item()  # the step trained the model


@pytest.mark.parametrize("value, on", [("auto", False), (True, True), (False, False)])
def test_pretraining_checkpoints_activations_only_when_asked(tmp_path, value, on):
    """train.activation_checkpointing in pretraining: true checkpoints each decoder layer; the default "auto" is off
    on a CPU (on a GPU it is decided with the micro-batch: test_auto_batch). [fails if: "auto" is read as true, or true
    is ignored]"""
    from engine.data import load_tokenizer
    from engine.parallel import init_distributed, world_from_env
    from engine.pretrain import build

    r = load_recipe(None, {"train.activation_checkpointing": value, "run_dir": str(tmp_path)})
    ds = resolve_ds_config(read_ds_config(ROOT / "ds_configs" / "zero2.json"), r, world_size=1, ranks_per_node=1,
                           auto_batch=AutoBatch())
    init_distributed()
    engine, _ = build(r, ds, load_tokenizer(r.data.tokenizer), world_from_env())
    assert engine.module.is_gradient_checkpointing is on


def test_shipped_recipes_find_their_bundled_data_from_any_directory(tmp_path, monkeypatch):
    """The shipped GRPO recipes name their prompts as `engine/assets/...` (from the checkout's root); from another
    working directory, as with an installed engine (`pip install .`), they still load and point at the bundled files,
    while a user's relative path stays relative to where the command runs."""
    monkeypatch.chdir(tmp_path)
    r = load_recipe(RECIPES / "grpo_tiny.yaml")
    assert Path(r.data.path).is_file() and Path(r.grpo.eval_path).is_file()
    assert Path(r.data.path) == ROOT / "engine" / "assets" / "arith_train.jsonl"
    (tmp_path / "engine" / "assets").mkdir(parents=True)
    (tmp_path / "engine" / "assets" / "arith_train.jsonl").write_text('{"prompt": "Q", "answer": "1"}\n')
    assert load_recipe(RECIPES / "grpo_tiny.yaml").data.path == "engine/assets/arith_train.jsonl"  # exists here
    with pytest.raises(ConfigError, match="grpo.eval_path engine/assets/nope.jsonl: no such file"):
        load_recipe(RECIPES / "grpo_tiny.yaml", {"grpo.eval_path": "engine/assets/nope.jsonl"})


def test_bad_input_lines_name_the_place_and_the_fix(tmp_path, monkeypatch):
    """A YAML syntax error says where; a GRPO count below 1 says which one; a DS config path that does not exist
    from this directory (the command run from outside the checkout) names the shipped file of that name."""
    from engine.ds_config import read_ds_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 5\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+ column \d+ \("):
        load_recipe(bad)
    with pytest.raises(ConfigError) as e:
        load_recipe(None, {"grpo.eval_every": 0})
    assert "grpo.eval_every (0) must be >= 1" in str(e.value) and "grpo.iterations" not in str(e.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"ds_configs/zero3.json: no such file \(the shipped one is "
                                          rf"{ROOT / 'ds_configs' / 'zero3.json'}\)"):
        read_ds_config("ds_configs/zero3.json")


def test_recipe_reports_every_problem_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hidden_size: big, num_expert: 4}\ntrain: {max_steps: 0}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    msg = str(e.value)
    assert "model.hidden_size: expected int, got 'big'" in msg
    assert "model.num_expert: unknown key" in msg
    assert "train.max_steps: must be >= 1" in msg


def cli_args(tmp_path, args, recipe: str | None) -> list[str]:
    argv = list(map(str, args))
    if recipe is not None:
        (tmp_path / "recipe.yaml").write_text(recipe)
        argv += ["--config", str(tmp_path / "recipe.yaml")]
    return argv + ["--run_dir", str(tmp_path / "run")]


def run_cli(tmp_path, *args, world: int = 1, recipe: str | None = None):
    """bin/pretrain.py as the launcher would start rank 0 of `world`; returns the finished process."""
    cmd = [sys.executable, str(PRETRAIN), *cli_args(tmp_path, args, recipe)]
    e = env(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    return subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120)


def run_in_this_process(tmp_path, *args, world: int = 1, recipe: str | None = None, capfd, monkeypatch):
    """run_cli's run, in this process (conftest.run_in_process)."""
    from engine.pretrain import main

    return run_in_process(main, cli_args(tmp_path, args, recipe), capfd, monkeypatch, cwd=tmp_path, RANK=0,
                          LOCAL_RANK=0, WORLD_SIZE=world, LOCAL_SIZE=world)


TINY = (RECIPES / "tiny.yaml").read_text()


@pytest.mark.parametrize("case, expect", [
    ("unknown_key", "train.max_step: unknown key"),
    ("wrong_type", "model.num_layers: expected int, got 'two'"),
    ("ep_not_dividing_experts", "autoep_size (3) must divide model.num_experts (8)"),
    ("ep_not_dividing_world", "autoep_size (4) must divide the world size (2)"),
    ("missing_data", "data.path /nonexistent/corpus.jsonl: no such file or folder"),
    ("tokenizer_too_big", "data.tokenizer has 483 tokens but model.vocab_size is 256"),
    ("batch_mismatch", "train_batch_size (10) != train_micro_batch_size_per_gpu (8) x gradient_accumulation_steps (1)"),
    ("malformed_json", "malformed JSON at line 1"),
    ("resume_without_checkpoint", "--resume: no checkpoint in"),
    ("compile_under_zero3", "train.compile: true needs ZeRO stage 1 or 2 (this config has stage 3), or ZeRO-3 with "
     'zero_optimization.leaf_module "auto"'),
    ("compile_bad_value", "train.compile: 'fast' is not one of true, false, auto"),
    ("recipe_and_json_together", "train.max_step: unknown key"),
    ("ds_and_data_together", "train_batch_size (10) != "),
    ("recipe_and_data_together", "train.max_step: unknown key"),
    ("negative_checkpoint_every", "checkpoint: every_steps and every_minutes must be >= 0"),
    ("balance_without_autoep", "train.balance_rate (0.01): the routing biases are balanced in DeepSpeed's AutoEP "
     "layers, and DeepSpeed config"),
    ("misspelled_section", "zero_optimisation: not a DeepSpeed setting (DeepSpeed would ignore it); did you mean "
                           "zero_optimization?"),
    ("grpo_prompts", "fix those rows or set data.text_field (its rows are GRPO prompts with answers: bin/grpo.py "
                     "trains on them)"),
])
def test_bad_input_is_one_clear_line_before_any_work(tmp_path, case, expect, capfd, monkeypatch):
    """engine.pretrain.main (what bin/pretrain.py runs) in this process, as rank 0 of `world`: exit 2, one line on
    stderr, nothing written. The same through a fresh process: test_bad_input_from_the_command_line_is_all_it_prints."""
    p = bad_input(tmp_path, case, lambda *a, **k: run_in_this_process(*a, capfd=capfd, monkeypatch=monkeypatch, **k))
    assert p.returncode == 2, p.stderr[-2000:]
    if case == "recipe_and_json_together":
        assert f"; DeepSpeed config {tmp_path / 'ds.json'}: malformed JSON at line 1" in p.stderr, p.stderr
    if case in ("ds_and_data_together", "recipe_and_data_together"):
        assert "data.path /nonexistent/corpus.jsonl: no such file or folder" in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], p.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_bad_input_from_the_command_line_is_all_it_prints(tmp_path):
    """One case of the test above through `python bin/pretrain.py` in a fresh process, as the launcher starts rank 0:
    nothing else on stderr (no import-time warning), exit 2, nothing written."""
    p = bad_input(tmp_path, "recipe_and_json_together", run_cli)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"; DeepSpeed config {tmp_path / 'ds.json'}: malformed JSON at line 1" in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "train.max_step: unknown key" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()


def bad_input(tmp_path, case: str, run):
    """Set up `case`'s broken input in tmp_path and run bin/pretrain.py's main on it with `run` (run_cli's
    signature); returns the finished run."""
    ds, args, recipe, world = ZERO3, [], None, 1
    if case == "unknown_key":
        recipe = TINY.replace("max_steps: 600", "max_step: 600")
    elif case == "wrong_type":
        recipe = TINY.replace("num_layers: 2", "num_layers: two")
    elif case == "ep_not_dividing_experts":
        ds = write_ds(tmp_path / "ds.json", expert_parallel={"enabled": True, "autoep_size": 3})
        world = 3
    elif case == "ep_not_dividing_world":
        ds = write_ds(tmp_path / "ds.json", expert_parallel={"enabled": True, "autoep_size": 4})
        world = 2
    elif case == "missing_data":
        args = ["--data", "/nonexistent/corpus.jsonl"]
    elif case == "tokenizer_too_big":
        recipe = TINY.replace("vocab_size: 512", "vocab_size: 256")
    elif case == "batch_mismatch":
        ds = write_ds(tmp_path / "ds.json", train_batch_size=10)
    elif case == "malformed_json":
        ds = tmp_path / "ds.json"
        ds.write_text('{"train_micro_batch_size_per_gpu": 8,, }')
    elif case == "recipe_and_json_together":  # two broken inputs: both named in the one line
        recipe = TINY.replace("max_steps: 600", "max_step: 600")
        ds = tmp_path / "ds.json"
        ds.write_text('{"train_micro_batch_size_per_gpu": 8,, }')
    elif case == "recipe_and_data_together":  # a recipe with a problem outside its data section: the data is checked
        recipe = TINY.replace("max_steps: 600", "max_step: 600")
        args = ["--data", "/nonexistent/corpus.jsonl"]
    elif case == "ds_and_data_together":
        ds = write_ds(tmp_path / "ds.json", train_batch_size=10)
        args = ["--data", "/nonexistent/corpus.jsonl"]
    elif case == "misspelled_section":
        cfg = json.loads(ZERO3.read_text())
        cfg["zero_optimisation"] = cfg.pop("zero_optimization")
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps(cfg))
    elif case == "grpo_prompts":  # GRPO's prompts file given to pretraining
        args = ["--data", ROOT / "engine" / "assets" / "arith_train.jsonl"]
    elif case == "balance_without_autoep":  # tiny.yaml balances at 0.01; without AutoEP nothing would
        ds = write_ds(tmp_path / "ds.json", drop=("expert_parallel",))
    elif case == "resume_without_checkpoint":
        args = ["--resume"]
    elif case == "negative_checkpoint_every":  # --checkpoint_every overrides checkpoint.every_steps
        args = ["--checkpoint_every", "-1"]
    elif case in ("compile_under_zero3", "compile_bad_value"):
        if case == "compile_under_zero3":  # ZeRO-3 hooking every module (no leaf_module): nothing to compile around
            cfg = json.loads(ZERO3.read_text())
            del cfg["zero_optimization"]["leaf_module"]
            ds = tmp_path / "ds.json"
            ds.write_text(json.dumps(cfg))
        recipe = TINY.replace("max_steps: 600", "max_steps: 600\n  compile: " + ("true" if case == "compile_under_zero3" else "fast"))
    return run(tmp_path, "--deepspeed_config", ds, *args, world=world, recipe=recipe)


def test_metrics_and_overrides_reach_the_run(tmp_path):
    """--max_steps/--run_dir/--data overrides on a local parquet file (1 rank, conftest.run_ranks: in this process);
    the DS config's monitor section receives the same metrics."""
    import datasets

    rows = [json.loads(line) for line in (ROOT / "engine" / "assets" / "corpus.jsonl").read_text().splitlines()[:2000]]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "docs.parquet"))
    from conftest import run_ranks

    ds = write_ds(tmp_path / "ds.json", csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"),
                                                     "job_name": "job"})
    run_ranks(1, PRETRAIN, "--deepspeed_config", ds, "--max_steps", "5", "--data", tmp_path / "docs.parquet",
              "--run_dir", tmp_path / "run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m[-1]["step"] == 5 and m[-1]["world_size"] == 1
    # model FLOPs, counted here from the recipe's shapes (not the engine's parameters): 6 x active non-embedding
    # parameters (experts at top-k / E, the output layer in) + 3 x layers x 2 x seq x heads x (qk + v head dims)
    from engine.auto_batch import param_counts

    r = load_recipe(None).model
    total, experts = param_counts(r)
    active = total - experts + experts * r.experts_per_token / r.num_experts - r.vocab_size * r.hidden_size
    seq = load_recipe(None).data.seq_len
    flops = 6 * active + 3 * r.num_layers * 2 * seq * r.num_heads * (r.qk_nope_head_dim + r.qk_rope_head_dim + r.v_head_dim)
    for row in m:
        assert row["tflops_per_s_per_rank"] == pytest.approx(row["tokens_per_s_per_rank"] * flops / 1e12, rel=1e-6)
        assert "mfu" not in row  # no known peak on a CPU
        assert 0 < row["grad_norm"] < float("inf") and row["skipped_steps"] == 0, row  # every update was made
    # DeepSpeed's monitor (csv here; tensorboard/wandb the same way) gets the rows metrics.jsonl gets
    csv_rows = (tmp_path / "csv" / "job" / "Train_loss.csv").read_text().split()[1:]
    assert [(int(a), float(b)) for a, b in (r.split(",") for r in csv_rows)] == [(r["step"], r["loss"]) for r in m]
    for layer in (0, 1):  # a per-layer list: one series per layer
        csv_rows = (tmp_path / "csv" / "job" / f"Train_expert_load_max_over_mean_{layer}.csv").read_text().split()[1:]
        assert [float(r.split(",")[1]) for r in csv_rows] == [r["expert_load_max_over_mean"][layer] for r in m]
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_00000005" / "engine_state.json").read_text())
    assert saved["recipe"]["data"]["path"] == str(tmp_path / "docs.parquet")


def test_a_rows_rate_leaves_out_checkpoint_saves_and_its_norm_is_before_clipping(tmp_path, monkeypatch):
    """Each row's tokens/s is over the steps since the last row, less the time spent saving checkpoints (a save
    here takes 1000 s on the run's clock); grad_norm is the norm before clipping (clipping at 1e-6 here)."""
    import types

    import engine.checkpoint
    import engine.pretrain
    from conftest import run_ranks

    skew = [0.0]
    real_time, real_save = time.time, engine.checkpoint.save
    monkeypatch.setattr(engine.pretrain, "time", types.SimpleNamespace(time=lambda: real_time() + skew[0]))

    def slow_save(*args, **kwargs):
        skew[0] += 1000.0
        return real_save(*args, **kwargs)

    monkeypatch.setattr(engine.checkpoint, "save", slow_save)
    recipe = TINY.replace("max_steps: 600", "max_steps: 5").replace("log_every: 10", "log_every: 2")
    (tmp_path / "r.yaml").write_text(recipe.replace("every_steps: 200", "every_steps: 3"))
    ds = write_ds(tmp_path / "ds.json", gradient_clipping=1e-6)
    run_ranks(1, PRETRAIN, "--deepspeed_config", ds, "--config", tmp_path / "r.yaml", "--run_dir", tmp_path / "run",
              cwd=tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [2, 4, 5] and skew[0] == 2000.0  # saved at steps 3 and 5 (the end)
    for r, n in zip(rows, (2, 2, 1)):
        seconds = n * (r["tokens"] / r["step"]) / r["tokens_per_s"]  # the row's window, from its own rate
        assert 0 < seconds < 200, (r, seconds)  # the tiny model's steps take well under a second each
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_rank"] * r["world_size"])
        assert r["grad_norm"] > 1e-3, r  # the unclipped norm (the tiny model's is ~1)


def test_a_row_is_standard_json_with_non_finite_values_as_null():
    """NaN and inf (a diverged loss, a skipped step's norm) are written as null, in lists too: standard JSON, which
    JavaScript's and jq's parsers read; finite values and the row's other fields are unchanged."""
    from engine.metrics import json_line

    row = {"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-4, "skipped_steps": 1,
           "expert_load_max_over_mean": [1.5, float("-inf")], "note": "x"}
    line = json_line(row)
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {**row, "loss": None, "grad_norm": None, "expert_load_max_over_mean": [1.5, None]}


def test_lr_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    from engine.parallel import warmup_cosine

    f = warmup_cosine(warmup=10, total=110, min_ratio=0.1)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # step s trains at (s+1)/warmup
    after = [f(s) for s in range(10, 111)]
    assert after[0] == 1.0 and all(a >= b for a, b in zip(after, after[1:]))
    assert f(60) == pytest.approx(0.55)  # halfway through the decay: halfway between 1 and the floor
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)  # stays at the floor past the end


def test_plain_text_files_are_documents_one_per_line(tmp_path):
    from engine.config import DataConfig
    from engine.data import load_documents

    (tmp_path / "a.txt").write_text("first document\nsecond one\n")
    (tmp_path / "b.txt").write_text("third\n")
    docs = load_documents(DataConfig(path=str(tmp_path)), streaming=False)
    assert sorted(docs["text"]) == ["first document", "second one", "third"]


BIG_MODEL_CONFIGS = ["zero3_offload.json", "zero3_bf16_states.json", "zero2_bf16_states.json"]


@pytest.fixture(scope="module")
def big_model_config_runs(tmp_path_factory) -> dict:
    """Each config of BIG_MODEL_CONFIGS as shipped, 20 steps of the tiny default on 2 CPU ranks (conftest.run_ranks:
    the rank pool)."""
    from conftest import run_ranks

    tmp = tmp_path_factory.mktemp("big_model_configs")
    for name in BIG_MODEL_CONFIGS:
        run_ranks(2, PRETRAIN, "--deepspeed_config", ROOT / "ds_configs" / name, "--max_steps", "20", "--run_dir",
                  tmp / name / "run", cwd=tmp)
    return {name: tmp / name / "run" for name in BIG_MODEL_CONFIGS}


@pytest.mark.parametrize("name", BIG_MODEL_CONFIGS)
def test_one_big_model_configs_train_the_default_on_two_cpu_ranks(big_model_config_runs, name):
    """The single-GPU configs for big models (CPU optimizer offload; bf16 optimizer states) as shipped: through
    the launcher on 2 CPU ranks they train the tiny default (the GPU figures are in docs/benchmarks.md)."""
    rows = read_metrics(big_model_config_runs[name])
    assert [r["step"] for r in rows] == [10, 20] and rows[-1]["world_size"] == 2
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, rows


def test_a_bf16_states_zero2_run_exports_its_own_weights(big_model_config_runs, tmp_path):
    """bin/zero_to_fp32 on the zero2_bf16_states.json run (bf16 master weights in the optimizer's partitions, which
    the ZeRO-1/2 reader takes the weights from): every exported tensor is fp32 and equals, value for value, the bf16
    weight the engine saved in its module state (the routed experts, saved apart, are covered for ZeRO-2 in
    tests/test_export.py)."""
    import glob

    import torch
    from safetensors.torch import load_file

    run = big_model_config_runs["zero2_bf16_states.json"]
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, str(ROOT / "bin" / "zero_to_fp32"), str(run), str(out)], cwd=tmp_path,
                       env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    exported = {}
    for f in out.glob("model-*.safetensors"):
        exported.update(load_file(f))
    tag = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    module = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert all(t.dtype == torch.float32 for t in exported.values())
    common = [k for k in module if k in exported]
    assert len(common) >= 20 and any(module[k].dtype == torch.bfloat16 for k in common), common
    differ = [k for k in common if not torch.equal(exported[k], module[k].float())]
    assert not differ, differ


ALONE = """
import sys
import time
from pathlib import Path
import engine.pretrain as p
p.FAIL_TOGETHER_S = 3
sys.exit(p.main(sys.argv[1:]))
"""


def test_a_refusing_rank_whose_peers_never_come_says_its_own_line(tmp_path):
    """Rank 0 of 2 refuses its input and joins the rendezvous to tell rank 1 (engine.pretrain.fail_together), but rank 1
    never starts (its node is down): after FAIL_TOGETHER_S it says its own line and exits 2, not after torch's 10 min.
    The case where the peers do come: tests/test_multinode.py, --resume before the sync."""
    from conftest import free_port

    e = env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", ALONE, "--deepspeed_config", str(ZERO3), "--max_steps", "0",
                        "--run_dir", str(tmp_path / "run")], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    took = time.time() - t0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and lines[-1].startswith("error: recipe ") and "train.max_steps: must be >= 1" in lines[-1], \
        p.stderr[-3000:]
    assert [line for line in lines if line.startswith("error")] == [lines[-1]], p.stderr[-3000:]
    assert took < 60, took
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_zero2_skips_a_non_finite_step_without_the_per_tensor_overflow_check(tmp_path, ranks):
    """engine.parallel.one_overflow_check drops DeepSpeed ZeRO-2's per-tensor inf/NaN check, leaving the global norm's
    check: a finite step still updates, and a step whose gradients hold NaN or inf (on one rank of two, too) is
    skipped on every rank (weights unchanged, one more skipped step, the norm reported as inf, in the metrics row as
    null), exactly as with DeepSpeed's own check put back (tests/scripts/overflow_steps.py)."""
    run_ranks(ranks, ROOT / "tests" / "scripts" / "overflow_steps.py", tmp_path / "out", cwd=tmp_path)
    for rank in range(ranks):
        got = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert got["dropped"]  # bf16, clipping, no offload
        steps = [(s["scale"], s["changed"], s["skipped_steps"], s["norm"] == "inf") for s in got["steps"]]
        assert steps == [("1.0", True, 0, False), ("nan", False, 1, True), ("inf", False, 2, True),
                         ("nan", False, 3, True), ("1.0", True, 3, False)], (rank, steps)
        # the metrics row: the count, and the norm as null on a skipped step (JSON has no inf)
        rows = [(s["row"]["skipped_steps"], s["row"]["grad_norm"]) for s in got["steps"]]
        assert rows == [(s["skipped_steps"], None if s["norm"] == "inf" else s["norm_value"]) for s in got["steps"]]
        assert all(r[1] is None or 0 < r[1] < float("inf") for r in rows)
