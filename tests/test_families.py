"""Model families from a user's own Hugging Face checkpoint (model.init_from): Mixtral, DeepSeek-V2 and Qwen3.5-MoE's
text model, each a tiny random-init model saved with save_pretrained and the bundled tokenizer
(tests/scripts/family_models.py), the recipe naming nothing but the directory.

Per family, tests/scripts/pretrain_logits.py trains 3 steps in fp32 under ZeRO-3 + AutoEP twice on the same global
batch: 1 rank x micro-batch 2 (in this process) and 2 ranks x micro-batch 1 (the rank pool, expert parallel 2: each
rank holds 2 of the 4 experts), saving the engine's logits for conftest.fixed_ids() before the first step and after
the last, and resumes the 2-rank run from its step-2 checkpoint on 2 ranks and on 1. Checked: the engine before
training equals transformers' own model loaded from the directory; 2 ranks train as 1; resume is exact (on another
world size: to summation order); the 2-rank checkpoint exported by bin/zero_to_fp32 loads with from_pretrained
under the family's own keys and gives the engine's logits. What a family cannot do is refused in one line before
any rank starts.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, check_decoder_follows_generate, fixed_ids, fp32_zero3, pretrain_job, read_metrics, run_in_process, run_ranks, write_ds

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from family_models import save_tiny  # noqa: E402

FAMILIES = {"mixtral": "mixtral", "deepseek_v2": "deepseek_v2", "qwen3_5_moe_text": "qwen3_5_moe"}  # -> model.arch
TOL = 1e-5
RECIPE = """
model: {{init_from: {init}}}
data: {{seq_len: 32}}
train: {{max_steps: 3, warmup_steps: 1, log_every: 1}}
checkpoint: {{every_steps: 2}}
"""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> dict:
    """One family's saved model and its 1-rank and 2-rank runs (conftest.pretrain_job dicts, with "before": the
    logits before the first step)."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    init = save_tiny(name, tmp / "hf")
    runs = {}
    for ranks in (1, 2):
        d = tmp / f"ranks{ranks}"
        d.mkdir()
        ds = fp32_zero3(d / "ds.json", FAMILIES[name], micro=3 - ranks)  # the same global batch of 2
        job, run = pretrain_job(d, RECIPE.format(init=init), ranks, ds)
        run_ranks(*job, "--logits_before", d / "before.pt", cwd=d)
        run["logits"], run["before"] = torch.load(d / "logits.pt"), torch.load(d / "before.pt")
        runs[ranks] = run
    for ranks in (2, 1):  # resumed from the 2-rank run's step-2 checkpoint: on 2 ranks, and on 1 (universal format)
        d = tmp / f"resume{ranks}"
        shutil.copytree(runs[2]["run"], d / "run")
        shutil.rmtree(d / "run" / "checkpoints" / "step_00000003")
        (d / "run" / "checkpoints" / "latest").write_text("step_00000002")
        ds = fp32_zero3(d / "ds.json", FAMILIES[name], micro=3 - ranks)
        job, run = pretrain_job(d, RECIPE.format(init=init), ranks, ds, corpus=runs[2]["dir"] / "corpus.jsonl")
        run_ranks(*job, "--resume", cwd=d)
        run["logits"] = torch.load(d / "logits.pt")
        runs[f"resume{ranks}"] = run
    return {"name": name, "init": init, **runs}


def hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=fixed_ids()).logits.float()


def test_the_engine_is_transformers_model_on_the_same_weights(family):
    """Before any step, the engine (AutoEP's routing and experts, ZeRO-3, on 1 rank and on 2 with expert parallel
    2) gives transformers' own logits for the model in the directory."""
    reference = hf_logits(family["init"])
    for ranks in (1, 2):
        diff = (family[ranks]["before"] - reference).abs().max().item()
        print(f"\n{family['name']} {ranks} rank(s): max abs logit diff engine vs transformers = {diff:.3g}")
        assert diff <= TOL, (ranks, diff)


def test_two_ranks_train_as_one(family):
    one, two = family[1], family[2]
    l1 = [r["loss"] for r in read_metrics(one["run"]) if "loss" in r]
    l2 = [r["loss"] for r in read_metrics(two["run"]) if "loss" in r]
    assert len(l1) == len(l2) == 3
    assert np.allclose(l1, l2, rtol=1e-5), (l1, l2)
    assert not torch.equal(one["logits"], one["before"])  # it trained
    # fp32 on both; they differ by summation order only (see tests/test_two_ranks.py), which Adam can amplify to ~1e-5
    # in a few parameters after 3 steps; a wrong expert slice or routing would move logits by far more than 1e-4.
    diff = (one["logits"] - two["logits"]).abs().max().item()
    print(f"\n{family['name']}: max abs logit diff 2 ranks vs 1 after 3 steps = {diff:.3g}")
    assert diff < 1e-4, diff


def test_resume_is_bitwise_and_continues_on_another_world_size(family):
    """Resumed at step 2 on 2 ranks, step 3 is the uninterrupted run's bit for bit; resumed on 1 rank (DeepSpeed's
    universal checkpoint, the same global batch), equal to fp32 summation order."""
    ref = family[2]
    last = [r for r in read_metrics(ref["run"]) if "loss" in r][-1]
    for ranks in (2, 1):
        run = family[f"resume{ranks}"]
        rows = [r for r in read_metrics(run["run"]) if "loss" in r and r["world_size"] == ranks]
        if ranks == 1:
            rows = [r for r in rows if r["step"] > 2]
        assert [r["step"] for r in rows][-1:] == [3], rows
        if ranks == 2:
            assert rows[-1]["loss"] == last["loss"]
            assert torch.equal(run["logits"], ref["logits"])
        else:
            assert abs(rows[-1]["loss"] - last["loss"]) < 5e-6 * last["loss"], (rows[-1], last)
            assert (run["logits"] - ref["logits"]).abs().max().item() < 1e-4


def test_a_checkpoint_that_recorded_the_recipes_own_architecture_fields_resumes(family, tmp_path):
    """A run started from model.init_from before its architecture was read from the directory recorded the recipe's
    unused fields (e.g. tiny.yaml's arch deepseek_v3, hidden 64); --resume with the same recipe still passes its
    checks (the model is the directory's, and the checkpoint's own weights are loaded)."""
    from engine.checkpoint import MANIFEST, check_resume
    from engine.checkpoint import manifest as checkpoint_manifest
    from engine.auto_batch import AutoBatch
    from engine.config import load_recipe
    from engine.ds_config import read_ds_config, resolve_ds_config

    run = tmp_path / "run"
    shutil.copytree(family[2]["run"], run)
    tag = run / "checkpoints" / "step_00000003"
    state = json.loads((tag / "engine_state.json").read_text())
    state["recipe"]["model"].update(arch="deepseek_v3", hidden_size=64, num_experts=8, num_shared_experts=1)
    (tag / "engine_state.json").write_text(json.dumps(state))
    manifest = json.loads((tag / MANIFEST).read_text())
    manifest["files"]["engine_state.json"] = checkpoint_manifest(tag)["engine_state.json"]  # as a save records it
    (tag / MANIFEST).write_text(json.dumps(manifest))
    recipe = load_recipe(family[2]["dir"] / "recipe.yaml", {"run_dir": str(run), "resume": True})
    ds = resolve_ds_config(read_ds_config(family[2]["ds"]), recipe, world_size=2, ranks_per_node=2,
                           auto_batch=AutoBatch())
    problems, universal = check_resume(recipe, ds, 2)
    assert problems == [] and not universal, problems


def test_export_loads_with_the_familys_keys_and_gives_the_engines_logits(family, tmp_path, capfd, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.export.write import main

    out = tmp_path / "hf"
    p = run_in_process(main, [family[2]["run"], out], capfd, monkeypatch)
    assert p.returncode == 0, p.stdout + p.stderr
    # transformers' own model of the directory, as loaded (its save_pretrained writes per-expert tensors instead, which
    # from_pretrained fuses on loading: either layout loads)
    own = {k: tuple(t.shape) for k, t in AutoModelForCausalLM.from_pretrained(family["init"]).state_dict().items()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in set(index["weight_map"].values()):
        with safe_open(out / name, "pt") as f:
            got.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    assert got == own
    assert AutoConfig.from_pretrained(out).architectures == AutoConfig.from_pretrained(family["init"]).architectures
    diff = (hf_logits(out) - family[2]["logits"]).abs().max().item()
    print(f"\n{family['name']}: max abs logit diff exported model vs engine = {diff:.3g}")
    assert diff <= TOL, diff
    # The checkpoint holds the config it trained with (and the init's generation config): the export needs the init
    # folder no more, whether it was moved, edited or named relative to another working directory.
    init, away = Path(family["init"]), Path(str(family["init"]) + ".away")
    init.rename(away)
    try:
        p = run_in_process(main, [family[2]["run"], tmp_path / "hf2"], capfd, monkeypatch)
    finally:
        away.rename(init)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (hf_logits(tmp_path / "hf2") - family[2]["logits"]).abs().max().item() <= TOL
    if (init / "generation_config.json").is_file():
        want = json.loads((init / "generation_config.json").read_text())
        assert json.loads((tmp_path / "hf2" / "generation_config.json").read_text()) == want


def test_zero2_export_of_a_shared_expert_gate_gives_the_engines_logits(tmp_path, capfd, monkeypatch):
    """ZeRO-2 (engine/export/zero12.py) on Qwen3.5-MoE, the family whose shared expert and its gate AutoEP renames:
    2 ranks, expert parallel 2, exported, loaded with from_pretrained, the engine's logits."""
    from engine.export.write import main

    init = save_tiny("qwen3_5_moe_text", tmp_path / "hf")
    z2 = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds = write_ds(tmp_path / "ds.json", base=ROOT / "ds_configs" / "zero2.json", drop=("bf16",),
                  train_micro_batch_size_per_gpu=1, expert_parallel={**z2["expert_parallel"], "autoep_size": 2})
    job, run = pretrain_job(tmp_path / "z2", RECIPE.format(init=init), 2, ds)
    run_ranks(*job, cwd=tmp_path / "z2")
    p = run_in_process(main, [run["run"], tmp_path / "out"], capfd, monkeypatch)
    assert p.returncode == 0, p.stdout + p.stderr
    diff = (hf_logits(tmp_path / "out") - torch.load(run["dir"] / "logits.pt")).abs().max().item()
    assert diff <= TOL, diff


# ------------------------------------------------------------------------------------------------- refusals


def recipe_problem(tmp_path: Path, text: str) -> str:
    from engine.config import ConfigError, load_recipe

    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_recipe(tmp_path / "r.yaml")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_init_from_takes_the_family_and_sizes_from_config_json(tmp_path):
    from engine.config import load_recipe

    for name, arch in FAMILIES.items():
        init = save_tiny(name, tmp_path / name)
        (tmp_path / "r.yaml").write_text(f"model: {{arch: deepseek_v3, hidden_size: 64, init_from: {init}}}\n")
        m = load_recipe(tmp_path / "r.yaml").model
        assert (m.arch, m.hidden_size, m.num_layers, m.num_experts, m.experts_per_token) == (arch, 32, 2, 4, 2)
        assert m.num_shared_experts == (0 if name == "mixtral" else 1)


def test_a_deepseek_config_with_fewer_key_value_heads_is_refused(tmp_path):
    """transformers' DeepSeek-V2 attention (MLA) fails in its first forward when num_key_value_heads differs from
    num_attention_heads ("The size of tensor a (4) must match the size of tensor b (8)" on every rank)."""
    init = save_tiny("deepseek_v2", tmp_path / "hf")
    cfg = json.loads((init / "config.json").read_text())
    (init / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
    line = recipe_problem(tmp_path, f"model: {{init_from: {init}}}\n")
    assert "config.json has num_key_value_heads 2 but num_attention_heads 4" in line
    assert "set num_key_value_heads to 4" in line


@pytest.mark.parametrize("model_type, expect", [
    ("llama", "model_type 'llama' is not a supported family (supported model_type values: deepseek_v3, deepseek_v2, "
              "qwen3_moe, qwen3_5_moe_text, mixtral)"),
    ("qwen3_5_moe", "model_type qwen3_5_moe is the Qwen3.5-MoE vision-language model; the engine trains its text-only "
                    "causal LM (model_type qwen3_5_moe_text)")])
def test_an_unsupported_model_type_is_refused(tmp_path, model_type, expect):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert expect in recipe_problem(tmp_path, f"model: {{init_from: {tmp_path / 'hf'}}}\n")


def grpo_from(init, tmp_path, capfd, monkeypatch):
    """bin/grpo.py --init_from INIT in this process (one rank): the process result and its non-empty stderr lines."""
    from engine.grpo import main

    p = run_in_process(main, ["--deepspeed_config", ROOT / "ds_configs" / "zero3_grpo.json", "--init_from", init,
                              "--run_dir", tmp_path / "run"], capfd, monkeypatch,
                       RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)
    return p, [x for x in p.stderr.splitlines() if x.strip()]


def test_a_model_dir_without_its_weights_is_refused_in_one_line(tmp_path, capfd, monkeypatch):
    """A save cut short (seen on the GPU machine: a timeout killed it while writing shards) leaves config.json alone;
    transformers reported that only in a traceback from every rank after GRPO had started. Refused before any rank
    starts, by model.init_from and by bin/grpo.py's --init_from; a sharded save's index naming a missing shard too."""
    init = save_tiny("deepseek_v2", tmp_path / "hf")
    weights = init / "model.safetensors"
    assert weights.is_file()
    assert load_recipe_ok(tmp_path, init)
    weights.rename(tmp_path / "elsewhere.safetensors")
    line = recipe_problem(tmp_path, f"model: {{init_from: {init}}}\n")
    assert line.endswith(f"model.init_from {init}: no weights next to config.json (none of model.safetensors, "
                    "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json; a save that was "
                    "cut short leaves config.json alone): save the model again, or point at a complete model directory")
    p, lines = grpo_from(init, tmp_path, capfd, monkeypatch)
    assert p.returncode == 2 and len(lines) == 1 and "no weights next to config.json" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()
    (init / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "elsewhere.safetensors").rename(init / "model-00001-of-00002.safetensors")
    line = recipe_problem(tmp_path, f"model: {{init_from: {init}}}\n")
    assert line.endswith("model.safetensors.index.json names 1 shard file(s) that are not there "
                         "(model-00002-of-00002.safetensors): copy them in, or save the model again")


def test_a_weights_file_cut_short_is_refused_in_one_line(tmp_path, capfd, monkeypatch):
    """A safetensors file whose copy stopped early (its header says more bytes than the file holds, or the header
    itself is cut): transformers stopped every rank with a SafetensorError traceback, exit 1. Refused before any rank
    starts, by model.init_from and by bin/grpo.py's --init_from, whole or sharded; a whole file passes. [fails if: a
    file is taken as whole by its name alone, or a shard named by the index is not read]"""
    init = save_tiny("deepseek_v2", tmp_path / "hf")
    weights = init / "model.safetensors"
    whole, intact = weights.stat().st_size, weights.read_bytes()
    assert load_recipe_ok(tmp_path, init)
    with open(weights, "r+b") as f:
        f.truncate(whole - 100)
    line = recipe_problem(tmp_path, f"model: {{init_from: {init}}}\n")
    assert line.endswith(f"model.init_from {init}: model.safetensors is cut short: {whole - 100:,} of the {whole:,} "
                         "bytes its header describes: copy it again, or save the model again"), line
    p, lines = grpo_from(init, tmp_path, capfd, monkeypatch)
    assert p.returncode == 2 and len(lines) == 1 and "model.safetensors is cut short" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()
    with open(weights, "r+b") as f:  # the header itself cut: 8 bytes of length and part of the JSON
        f.truncate(40)
    weights.rename(init / "model-00001-of-00002.safetensors")  # sharded: the first shard cut, the second whole
    (init / "model-00002-of-00002.safetensors").write_bytes(intact)
    index = {"weight_map": {"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"}}
    (init / "model.safetensors.index.json").write_text(json.dumps(index))
    line = recipe_problem(tmp_path, f"model: {{init_from: {init}}}\n")
    assert line.endswith("model-00001-of-00002.safetensors is not a readable safetensors file (40 bytes, its header "
                         "cut or damaged): copy it again, or save the model again"), line


def test_the_family_and_sizes_are_read_from_a_config_only_dir(tmp_path):
    """GRPO's "auto" batch writes the model's config.json alone to a temporary dir and reads its sizes with
    model_from_hf_dir: the weights check belongs to the recipe and --init_from, not there."""
    from transformers import AutoConfig

    from engine.config import ModelConfig, model_from_hf_dir

    init = save_tiny("deepseek_v2", tmp_path / "hf")
    AutoConfig.from_pretrained(init).save_pretrained(tmp_path / "config_only")
    m = ModelConfig(init_from=str(tmp_path / "config_only"))
    assert model_from_hf_dir(m) == []
    assert (m.arch, m.hidden_size, m.num_experts) == ("deepseek_v2", 32, 4) != (ModelConfig().arch, 64, 8)


def test_home_relative_paths_in_a_recipe_are_the_users_home(tmp_path, monkeypatch):
    """A recipe is read by no shell: `~/...` in model.init_from, data.path, data.tokenizer, grpo.eval_path and run_dir
    is expanded as a shell would (model.init_from said "no config.json" for a directory that has one, and the
    tokenizer went to transformers as a hub name). [fails if: any of them is kept as written]"""
    from engine.config import load_recipe

    monkeypatch.setenv("HOME", str(tmp_path))
    save_tiny("deepseek_v2", tmp_path / "hf")
    for name in ("c.jsonl", "e.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "r.yaml").write_text("model: {init_from: ~/hf}\ndata: {path: ~/c.jsonl, tokenizer: ~/tok}\n"
                                     "grpo: {eval_path: ~/e.jsonl}\nrun_dir: ~/runs/x\n")
    r = load_recipe(tmp_path / "r.yaml")
    assert r.model.arch == "deepseek_v2" and r.model.init_from == str(tmp_path / "hf")
    assert (r.data.path, r.data.tokenizer, r.grpo.eval_path, r.run_dir) == tuple(
        str(tmp_path / n) for n in ("c.jsonl", "tok", "e.jsonl", "runs/x"))


def load_recipe_ok(tmp_path, init) -> bool:
    from engine.config import load_recipe

    (tmp_path / "ok.yaml").write_text(f"model: {{init_from: {init}}}\n")
    return load_recipe(tmp_path / "ok.yaml").model.arch == "deepseek_v2"


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2", "qwen3_5_moe"])
def test_aux_loss_free_balancing_is_refused_without_a_routing_bias(tmp_path, arch):
    line = recipe_problem(tmp_path, f"model: {{arch: {arch}}}\ntrain: {{balance_rate: 0.01}}\n")
    assert f"train.balance_rate: aux-loss-free balancing needs a routing-bias buffer that {arch} does not have" in line


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2", "qwen3_5_moe"])
def test_pipeline_mode_is_refused(tmp_path, arch, capfd, monkeypatch):
    from engine.pretrain import main

    (tmp_path / "r.yaml").write_text(f"model: {{arch: {arch}}}\ntrain: {{max_steps: 1}}\n")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    p = run_in_process(main, ["--deepspeed_config", ROOT / "ds_configs" / "pipe.json", "--config", tmp_path / "r.yaml",
                              "--run_dir", tmp_path / "run"], capfd, monkeypatch)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert f"model.arch {arch}: pipeline mode builds its stages for deepseek_v3 and qwen3_moe only" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_rollout_decoder_refuses_gated_deltanet():
    """Measured before refusing: the decoder's greedy tokens differed from generate's on a tiny Qwen3.5-MoE (its Gated
    DeltaNet state is not in the static cache)."""
    from engine.config import ModelConfig
    from engine.grpo import decoder_family_problem
    from engine.model import make_hf_config

    for arch in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral"):
        assert decoder_family_problem(make_hf_config(ModelConfig(arch=arch, num_kv_heads=2 if arch in (
            "qwen3_moe", "mixtral") else 4))) is None
    line = decoder_family_problem(make_hf_config(ModelConfig(arch="qwen3_5_moe", num_layers=4)))
    assert line.startswith("grpo.rollout: local (the persistent rollout decoder) cannot take a qwen3_5_moe_text model: "
                           "its Gated DeltaNet (linear attention) layers keep a recurrent state")
    assert line.endswith("set grpo.rollout: engine (generation through the DeepSpeed engine)")


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_the_rollout_decoder_samples_the_family_as_generate(arch, monkeypatch):
    """As tests/test_rollout.py checks DeepSeek-V3: greedy tokens equal transformers' generate on the same weights,
    again after every weight changed and the decoder was refreshed in place. DeepSeek-V2: its own rotary embedding
    (complex pairs, engine/decoder.py: deepseek_v2_cos_sin) and softmax routing through the absorbed MLA."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as hf_deepspeed

    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)  # a ZeRO-3 engine built earlier here
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(ModelConfig(arch=arch, num_kv_heads=2 if arch == "mixtral"
                                                                        else 4))).eval()
    ids = torch.randint(1, 512, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    dec = Decoder(model, "cpu", batch_size=4, cache_len=32, decode_experts="dense")  # the GPUs' default
    check_decoder_follows_generate(model, dec, ids, mask)


def test_grpo_refuses_a_model_of_another_family_in_one_line(tmp_path, capfd, monkeypatch):
    from engine.grpo import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    p = run_in_process(main, ["--deepspeed_config", ROOT / "ds_configs" / "zero3_grpo.json", "--init_from",
                              tmp_path / "hf", "--run_dir", tmp_path / "run"], capfd, monkeypatch,
                       RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0] == (f"error: --init_from {tmp_path / 'hf'}: model_type 'llama' is not a supported family "
                        "(supported model_type values: deepseek_v3, deepseek_v2, qwen3_moe, qwen3_5_moe_text, mixtral)")
    assert not (tmp_path / "run").exists()


GRPO_RECIPE = """
model: {{init_from: {init}}}
data: {{path: {prompts}}}
train: {{max_steps: 2, lr: 1.0e-3, warmup_steps: 0, log_every: 1}}
grpo: {{group_size: 4, max_new_tokens: 4, rollout: {rollout},
       rewards: [{{name: length_penalty, target: 2, scale: 0.1}}]}}
checkpoint: {{at_end: false}}
"""


def test_grpo_on_gated_deltanet_generates_through_the_engine(tmp_path, capfd, monkeypatch):
    """Qwen3.5-MoE on 2 ranks: grpo.rollout auto says why it picks the engine and trains 2 steps on its rollouts;
    grpo.rollout: local is refused in one line before any rank starts, and so is auto with a setting only the local
    decoder carries out (routing replay, rollout correction, min_new_tokens)."""
    from engine.grpo import main

    init = save_tiny("qwen3_5_moe_text", tmp_path / "hf")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                                                    for p in ("Q: 2 + 3 = ? A:", "Gus went to the harbor with")))
    ds = write_ds(tmp_path / "ds.json", base=ROOT / "ds_configs" / "zero3_grpo.json", drop=("bf16",),
                  train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    needs_local = {"r3": ("routing_replay: r3", "grpo.routing_replay r3"),
                   "tis": ("rollout_correction: tis", "grpo.rollout_correction tis"),
                   "min_new": ("min_new_tokens: 2", "grpo.min_new_tokens")}
    for name, rollout in (("auto", "auto"), ("local", "local"),
                          *((k, f"auto, {key}") for k, (key, _) in needs_local.items())):
        (tmp_path / f"{name}.yaml").write_text(GRPO_RECIPE.format(init=init, prompts=tmp_path / "prompts.jsonl",
                                                                  rollout=rollout))
    for name, why in (("local", ""), *((k, f" ({what} needs the local decoder)") for k, (_, what) in needs_local.items())):
        argv = ["--deepspeed_config", ds, "--config", tmp_path / f"{name}.yaml", "--run_dir", tmp_path / "refused"]
        p = run_in_process(main, argv, capfd, monkeypatch, RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_SIZE=2)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0].startswith("error: grpo.rollout: local (the persistent rollout decoder) cannot take a "
                                   "qwen3_5_moe_text model: its Gated DeltaNet"), lines[0]
        assert lines[0].endswith(why), lines[0]
    p = run_ranks(2, ROOT / "bin" / "grpo.py", "--deepspeed_config", ds, "--config", tmp_path / "auto.yaml",
                  "--run_dir", tmp_path / "run", cwd=tmp_path)
    assert "grpo.rollout auto picks engine" in p.stdout
    rows = [r for r in read_metrics(tmp_path / "run") if "generated_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["generated_tokens"] > 0 for r in rows)
    assert not any("decode_ms_per_step" in r for r in rows)  # the engine generated, not the local decoder
    for r in rows:  # its generate call's time per step of the longest completion (between the mean and max_new_tokens)
        assert 1000 * r["rollout_s"] / 4 - 1e-6 <= r["rollout_ms_per_step"] <= 1000 * r["rollout_s"] / r["response_len"] + 1e-6, r


def test_grpo_on_deepseek_v2_samples_with_the_local_decoder(tmp_path):
    """DeepSeek-V2 on 2 ranks (ZeRO-3, expert parallel 2, fp32) with grpo.rollout auto: the local decoder samples (its
    copy refreshed from the AutoEP policy), and what it sampled from is what the trainer computes: every response
    token's log-prob and every expert choice agree with the policy's first training forward (fp32: summation order
    only). With routing replay on, as the decoder's recording makes possible."""
    init = save_tiny("deepseek_v2", tmp_path / "hf")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                                                    for p in ("Q: 2 + 3 = ? A:", "Gus went to the harbor with")))
    (tmp_path / "grpo.yaml").write_text(GRPO_RECIPE.format(init=init, prompts=tmp_path / "prompts.jsonl",
                                                           rollout="auto, routing_replay: r3"))
    ds = write_ds(tmp_path / "ds.json", base=ROOT / "ds_configs" / "zero3_grpo.json", drop=("bf16",),
                  train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    p = run_ranks(2, ROOT / "bin" / "grpo.py", "--deepspeed_config", ds, "--config", tmp_path / "grpo.yaml",
                  "--run_dir", tmp_path / "run", cwd=tmp_path)
    assert "picks engine" not in p.stdout
    rows = [r for r in read_metrics(tmp_path / "run") if "generated_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["generated_tokens"] > 0 for r in rows)
    for r in rows:
        assert r["decode_ms_per_step"] > 0  # the local decoder generated
        assert r["rollout_logp_diff_max"] < 1e-4, r
        assert r["routing_agree_choice"] == 1.0 and r["routing_live_agree_choice"] == 1.0, r


def test_no_shared_expert_is_refused_where_transformers_builds_one():
    """transformers' DeepSeek-V3/V2 and Qwen3.5-MoE always build the shared-expert block: with
    num_shared_experts 0 it was zero-wide, ZeRO-3 failed in its first step and the ZeRO-2 export refused the
    zero-element parameters. Qwen3-MoE and Mixtral have no shared expert to build."""
    from engine.config import ConfigError, load_recipe

    for arch in ("deepseek_v3", "deepseek_v2", "qwen3_5_moe"):
        with pytest.raises(ConfigError, match=rf"model.num_shared_experts: 0, but transformers' {arch} always builds"):
            load_recipe(None, {"model.arch": arch, "model.num_shared_experts": 0, "train.balance_rate": 0.0})
    for arch in ("qwen3_moe", "mixtral"):
        load_recipe(None, {"model.arch": arch, "model.num_shared_experts": 0, "train.balance_rate": 0.0})
        # and a dense first layer, which make_hf_config would not build for these families: refused, not ignored
        with pytest.raises(ConfigError, match=rf"model.first_dense_layers: {arch} is built with an MoE block"):
            load_recipe(None, {"model.arch": arch, "model.first_dense_layers": 1, "train.balance_rate": 0.0})
        # and shared experts it would not build either (1 is the field's default, read as none)
        with pytest.raises(ConfigError, match=rf"model.num_shared_experts: {arch} has no shared experts"):
            load_recipe(None, {"model.arch": arch, "model.num_shared_experts": 2, "train.balance_rate": 0.0})
