"""bin/zero_to_fp32: real checkpoints (ZeRO-3 + AutoEP on 1, 2 and 4 CPU ranks; ZeRO-2 and ZeRO-1 + AutoEP on 2)
exported to Hugging Face format give the engine's logits and, tensor for tensor, the engine's own weights; GRPO
starts from a ZeRO-2 run; bad input gets one line, exit 2, and leaves the output alone.

The runs: tests/scripts/pretrain_logits.py (bin/pretrain.py, then the trained engine's logits for fixed ids and, for
the 2-rank DeepSeek-V3 runs, its gathered weights), one job per layout (conftest.run_ranks: 2 ranks on the rank pool,
1 in this process, 4 a launch of its own); the 2-rank ZeRO-3 DeepSeek-V3 run is conftest's session fixture
deepseek_2ranks, shared with tests/test_pipeline.py. bin/zero_to_fp32 runs in this process (engine.export.write.main,
conftest.run_in_process) except in test_missing_checkpoint_dir (a fresh process: only the one line on stderr), the
memory test and the script DeepSpeed's is replaced with.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (ROOT, SMALL_DEEPSEEK, env, finished, fixed_ids, fp32_zero3, launch, pretrain_job, read_metrics,
                      run_in_process, run_ranks, write_ds)

sys.path.insert(0, str(ROOT))
ZERO_TO_FP32 = ROOT / "bin" / "zero_to_fp32"
PRETRAIN = ROOT / "bin" / "pretrain.py"
GRPO = ROOT / "bin" / "grpo.py"
ZERO2 = ROOT / "ds_configs" / "zero2.json"
TOL = 1e-5

QWEN = """
model: {arch: qwen3_moe, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2, intermediate_size: 64,
        moe_intermediate_size: 48, num_experts: 4, experts_per_token: 2, vocab_size: 512,
        max_position_embeddings: 128}
data: {seq_len: 32}
train: {max_steps: 3, warmup_steps: 1, log_every: 1}
"""


def layout(tmp: Path, recipe: str, ranks: int, preset: str, autoep_size="auto") -> tuple[tuple, dict]:
    """The launch that trains `recipe` on `ranks` CPU ranks in fp32 and gets the engine's logits (conftest.pretrain_job)."""
    tmp.mkdir(parents=True)
    return pretrain_job(tmp, recipe, ranks, fp32_zero3(tmp / "ds.json", preset, autoep_size))


def pretrain(tmp: Path, recipe: str, ranks: int, preset: str, autoep_size="auto") -> list:
    """bin/pretrain.py on `ranks` CPU ranks in fp32 into tmp/run; returns its arguments (without the script)."""
    _, run = layout(tmp, recipe, ranks, preset, autoep_size)
    run_ranks(ranks, PRETRAIN, *run["common"], cwd=tmp)
    return run["common"]


@pytest.fixture(scope="module")
def deepseek2(deepseek_2ranks):
    return deepseek_2ranks


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """DeepSeek-V3 and Qwen3-MoE on 1 rank (conftest.run_ranks: in this process)."""
    tmp = tmp_path_factory.mktemp("export")
    (ds_job, ds_run), (qw_job, qw_run) = (layout(tmp / "deepseek1", SMALL_DEEPSEEK, 1, "deepseek_v3"),
                                          layout(tmp / "qwen1", QWEN, 1, "qwen3_moe"))
    run_ranks(*ds_job, cwd=tmp)
    run_ranks(*qw_job, cwd=tmp)
    return {"deepseek1": finished(ds_run), "qwen1": finished(qw_run)}


@pytest.fixture(scope="module")
def deepseek1(one_rank):
    return one_rank["deepseek1"]


@pytest.fixture(scope="module")
def qwen1(one_rank):
    return one_rank["qwen1"]


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    # 4 ranks, expert parallel 2: each expert slice is also ZeRO-partitioned over 2 ranks (expert data parallel).
    tmp = tmp_path_factory.mktemp("export") / "qwen4"
    job, run = layout(tmp, QWEN, 4, "qwen3_moe", autoep_size=2)
    launch(*job, cwd=tmp)
    return finished(run)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    # 2 ranks, expert parallel 2: each rank holds 2 of the 4 experts whole, dense parameters half each.
    tmp = tmp_path_factory.mktemp("export") / "qwen2"
    job, run = layout(tmp, QWEN, 2, "qwen3_moe", autoep_size=2)
    run_ranks(*job, cwd=tmp)
    return finished(run)


def fp32_zero12(path: Path, stage: int) -> Path:
    """ds_configs/zero2.json in fp32 (bf16 dropped), micro-batch 2, AutoEP size 2 with the DeepSeek-V3 preset; stage 1
    is the same file with zero_optimization.stage 1 (no ZeRO-1 config ships)."""
    z2 = json.loads(ZERO2.read_text())
    return write_ds(path, base=ZERO2, drop=("bf16",), train_micro_batch_size_per_gpu=2,
                    zero_optimization={**z2["zero_optimization"], "stage": stage},
                    expert_parallel={**z2["expert_parallel"], "preset_model": "deepseek_v3", "autoep_size": 2})


def zero12_run(tmp_path_factory, stage: int) -> dict:
    """conftest.deepseek_2ranks's run (SMALL_DEEPSEEK, 2 ranks on the rank pool, expert parallel 2: each rank holds 2
    of the 4 experts) under ZeRO stage 1 or 2, with the trained engine's logits and gathered weights."""
    tmp = tmp_path_factory.mktemp(f"zero{stage}")
    job, run = pretrain_job(tmp, SMALL_DEEPSEEK, 2, fp32_zero12(tmp / "ds.json", stage), weights=True)
    run_ranks(*job, cwd=tmp)
    return finished(run)


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return zero12_run(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return zero12_run(tmp_path_factory, 1)


@pytest.fixture(autouse=True)
def _in_process(capfd, monkeypatch):
    """bin/zero_to_fp32 in this process for every test here (see zero_to_fp32)."""
    global CAPTURE
    CAPTURE = (capfd, monkeypatch)
    yield
    CAPTURE = None


CAPTURE = None


def zero_to_fp32(*args) -> subprocess.CompletedProcess:
    """`bin/zero_to_fp32 ARGS`: its main in this process, everything written to fds 1 and 2 captured."""
    from engine.export.write import main

    return run_in_process(main, list(args), *CAPTURE)


def zero_to_fp32_process(*args) -> subprocess.CompletedProcess:
    """`bin/zero_to_fp32 ARGS` in a fresh process."""
    return subprocess.run([sys.executable, str(ZERO_TO_FP32), *map(str, args)], env=env(), capture_output=True,
                          text=True, timeout=300)


def export_ok(*args) -> None:
    p = zero_to_fp32(*args)
    assert p.returncode == 0, p.stdout + p.stderr


def latest_tag(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def fresh_state(run: Path) -> dict:
    """State dict of a freshly built transformers model of the run's recorded config (engine/model.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import ModelConfig
    from engine.model import make_hf_config as hf_config

    ckpt = latest_tag(run)
    model_section = json.loads((ckpt / "engine_state.json").read_text())["recipe"]["model"]
    cfg = hf_config(ModelConfig(**model_section), AutoTokenizer.from_pretrained(ckpt / "tokenizer"))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg).state_dict()


def exported_tensors(out: Path) -> dict:
    from safetensors.torch import load_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / name))
    assert set(index["weight_map"]) == set(tensors)
    return tensors


def hf_logits(out: Path, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=fixed_ids()).logits.float()


def engine_weights_as_hf(weights: dict) -> dict:
    """The engine's gathered DeepSeek-V3 weights (engine names: AutoEP's router and stacked experts) under Hugging
    Face's names, written out here independently of engine/export: router.gate.weight -> gate.weight,
    router.e_score_correction_bias -> gate.e_score_correction_bias, experts.w1/w3 [E, ffn, hidden] -> gate_up_proj =
    cat(w1, w3) along dim 1, experts.w2 -> down_proj."""
    out, experts = {}, {}
    for name, t in weights.items():
        m = re.fullmatch(r"(.*\.mlp)\.experts\.(w[123])", name)
        if m:
            experts.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        name = re.sub(r"\.mlp\.router\.gate\.", ".mlp.gate.", name)
        out[re.sub(r"\.mlp\.router\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias", name)] = t
    for moe, w in experts.items():
        out[f"{moe}.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[f"{moe}.experts.down_proj"] = w["w2"]
    return out


# ranks, expert-parallel size, ZeRO stage, reader (engine/export/: zero3.py or zero12.py)
LAYOUTS = {"deepseek2": (2, 2, 3, "zero3"), "deepseek1": (1, 1, 3, "zero3"), "qwen4": (4, 2, 3, "zero3"),
           "qwen2": (2, 2, 3, "zero3"), "qwen1": (1, 1, 3, "zero3"), "zero2": (2, 2, 2, "zero12"),
           "zero1": (2, 2, 1, "zero12")}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_export_gives_the_engines_logits(case, request, tmp_path):
    from engine.export import layout as reader

    run = request.getfixturevalue(case)
    tag = latest_tag(run["run"])
    state = json.loads((tag / "engine_state.json").read_text())
    stage = json.loads(Path(run["ds"]).read_text())["zero_optimization"]["stage"]
    assert (state["world_size"], state["autoep_size"], stage, reader(tag)) == LAYOUTS[case]
    out = tmp_path / "hf"
    export_ok(run["run"], out)  # a run dir: its checkpoints/latest

    # Safetensors only: the weights, their index, the two configs and the tokenizer's files (no .bin/.pt/.pkl).
    tokenizer = {f.name for f in (latest_tag(run["run"]) / "tokenizer").iterdir()}
    assert tokenizer and not {f for f in tokenizer if f.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle"))}
    names = {f.name for f in out.iterdir()}
    assert all(f.is_file() for f in out.iterdir())
    assert names - tokenizer == {"model.safetensors.index.json", "config.json", "generation_config.json",
                                 *(f.name for f in out.glob("model-*-of-*.safetensors"))}

    fresh = fresh_state(run["run"])
    tensors = exported_tensors(out)
    assert set(tensors) == set(fresh)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == {k: tuple(t.shape) for k, t in fresh.items()}
    assert all(t.dtype == torch.float32 for t in tensors.values())
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f

    logits = hf_logits(out)
    diff = (logits - run["logits"]).abs().max().item()
    print(f"\n{case}: max abs logit diff engine vs exported HF model = {diff:.3g}")
    assert logits.shape == run["logits"].shape
    assert diff <= TOL

    if "weights" in run:  # the 2-rank DeepSeek-V3 runs: every tensor is the trained engine's own, bitwise
        engine = engine_weights_as_hf(run["weights"])
        assert set(tensors) <= set(engine), sorted(set(tensors) - set(engine))
        differ = [k for k in tensors if not torch.equal(tensors[k], engine[k])]
        print(f"{case}: {len(tensors) - len(differ)} of {len(tensors)} exported tensors equal the engine's")
        assert not differ, differ


def test_routing_bias_is_trained_and_exported(deepseek2, tmp_path):
    out = tmp_path / "hf"
    export_ok(deepseek2["run"] / "checkpoints", out, "--tag", "step_00000003")  # the checkpoints dir works too
    tensors = exported_tensors(out)
    biases = [t for k, t in tensors.items() if k.endswith("mlp.gate.e_score_correction_bias")]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # balance_rate moved them


def test_sharded_bf16_export(deepseek2, tmp_path):
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    export_ok(deepseek2["run"], fp32)
    export_ok(deepseek2["run"], bf16, "--dtype", "bf16", "--max_shard_size", "60KB")
    shards = sorted(bf16.glob("model-*.safetensors"))
    assert len(shards) > 3 and all(f.stat().st_size <= 60_000 + 20_000 for f in shards)
    a, b = exported_tensors(fp32), exported_tensors(bf16)
    assert set(a) == set(b)
    for k in a:
        if k.endswith("e_score_correction_bias"):  # transformers keeps it in fp32 (_keep_in_fp32_modules_strict)
            assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k])
        else:
            assert b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]), k
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    # The bf16 model (loaded as bf16, biases in fp32) against the fp32 engine: bf16 keeps 8 significant bits, so each
    # rounded weight and each bf16 matmul moves these logits (|logit| <= 0.58) by ~1e-3. Measured (2026-12-02): 3.6e-3.
    # 1e-2 leaves ~3x; two experts of one MoE layer swapped moved them by 2.1e-2 to 4.6e-2 (6 swaps, either MoE layer;
    # the old bound, 0.1, passed them all). The exact per-tensor check above is what ties bf16 to the fp32 export.
    diff = (hf_logits(bf16, torch.bfloat16) - deepseek2["logits"]).abs().max().item()
    print(f"\nbf16 export vs the fp32 engine: max abs logit diff {diff:.3g}")
    assert diff < 1e-2, diff


def test_bf16_run_file_names(deepseek2, tmp_path):
    """bf16 runs name the optimizer files bf16_zero_pp_rank_*; their content is the same fp32 partitions."""
    tag = copy_checkpoint(deepseek2["run"], tmp_path / "copy")
    for f in tag.glob("zero_pp_rank_*_optim_states.pt"):
        f.rename(tag / f"bf16_{f.name}")
    reseal(tag)
    export_ok(tag, tmp_path / "a")  # a checkpoint folder itself
    export_ok(deepseek2["run"], tmp_path / "b")
    a, b = exported_tensors(tmp_path / "a"), exported_tensors(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# 1 prompt x G=4 per rank per step (micro-batch 4, no accumulation), one step; length_penalty gives the completions
# of one group different rewards, so the step has advantages to learn from.
GRPO_RECIPE = """
data: {path: PROMPTS}
train: {max_steps: 1, lr: 1.0e-3, warmup_steps: 0, log_every: 1}
grpo: {group_size: 4, max_new_tokens: 8, temperature: 0.7, beta: 0.04,
       rewards: [{name: numeric, which: first}, {name: length_penalty, target: 3, scale: 0.1}]}
checkpoint: {at_end: false}
"""


@pytest.mark.parametrize("source", ["export", "run_dir"])
def test_grpo_starts_from_a_zero2_run(zero2, source, tmp_path):
    """bin/grpo.py on 2 ranks (zero2_grpo.json in fp32) from the ZeRO-2 run's Hugging Face export, and from the run
    dir itself: --init_from RUN_DIR exports it into RUN/init_hf through the same exporter, before training."""
    from test_grpo import PROMPTS

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (tmp_path / "grpo.yaml").write_text(GRPO_RECIPE.replace("PROMPTS", str(tmp_path / "prompts.jsonl")))
    ds = write_ds(tmp_path / "ds.json", base=ROOT / "ds_configs" / "zero2_grpo.json", drop=("bf16",),
                  train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    hf = tmp_path / "hf"
    export_ok(zero2["run"], hf)
    run_ranks(2, GRPO, "--deepspeed_config", ds, "--config", tmp_path / "grpo.yaml", "--init_from",
              hf if source == "export" else zero2["run"], "--run_dir", tmp_path / "grpo", cwd=tmp_path, timeout=300)
    rows = read_metrics(tmp_path / "grpo")
    assert [r["step"] for r in rows] == [1], rows
    assert all(v == v for v in rows[0].values() if isinstance(v, float)), rows  # no NaN
    if source == "run_dir":  # what GRPO trained from is the export of the run's `latest`, tensor for tensor
        a, b = exported_tensors(tmp_path / "grpo" / "init_hf"), exported_tensors(hf)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_script_beside_the_checkpoints_is_ours(zero2, tmp_path):
    """DeepSpeed copies its own zero_to_fp32.py (and zero_to_torch.py, which imports it) next to the checkpoints at
    every save; they cannot export these checkpoints. The engine replaces both with a script that runs
    bin/zero_to_fp32, found from the checkout that wrote them: run in a fresh process without PYTHONPATH, it exports."""
    ck = zero2["run"] / "checkpoints"
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert "moe-engine" in (ck / name).read_text() and os.access(ck / name, os.X_OK), name
    p = subprocess.run([sys.executable, ck / "zero_to_fp32.py", ck, tmp_path / "a", "--quiet"],
                       env=env(PYTHONPATH=""), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and not p.stdout.strip(), p.stdout + p.stderr
    export_ok(zero2["run"], tmp_path / "b")
    a, b = exported_tensors(tmp_path / "a"), exported_tensors(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("transposed", [False, True])
def test_expert_pieces_land_in_place(transposed):
    """Fragments cut anywhere (across experts and rows) assemble HF's fused layout, plain or is_transposed."""
    from engine.export.plan import Frag, Target, place

    E, ffn, hidden, ep = 4, 3, 5, 2
    w1, w3, w2 = torch.randn(E, ffn, hidden), torch.randn(E, ffn, hidden), torch.randn(E, hidden, ffn)
    gate_up, down = torch.cat([w1, w3], dim=1), w2
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    owned = {0: [3, 1], 1: [0, 2]}  # a non-contiguous placement
    out = {"gu": torch.full_like(gate_up, float("nan")), "d": torch.full_like(down, float("nan"))}
    gen = torch.Generator().manual_seed(0)
    for w, key, kind in ((w1, "gu", "gate"), (w3, "gu", "up"), (w2, "d", "down")):
        for r in range(ep):
            local = w[owned[r]].reshape(-1)
            cuts = sorted(set(torch.randint(1, local.numel(), (6,), generator=gen).tolist()))
            for a, b in zip([0] + cuts, cuts + [local.numel()]):
                frag = Frag((), 0, b - a, a, Target(key, kind, owned[r]))
                assert place(out[key], frag, local[a:b], transposed) == b - a
    assert torch.equal(out["gu"], gate_up) and torch.equal(out["d"], down)


# -------------------------------------------------------------------------------------------------- memory

# ~437 MiB in fp32 (the model of tests/test_two_ranks.py's memory test), one step: its checkpoint's one
# optimizer file holds the whole model's fp32 masters (plus Adam moments).
BIG = """
model: {arch: deepseek_v3, hidden_size: 512, num_layers: 8, num_heads: 4, intermediate_size: 512,
        moe_intermediate_size: 1024, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 512}
data: {seq_len: 32}
train: {max_steps: 1, warmup_steps: 0, log_every: 1}
"""
SHARD_MB = 20


def test_export_streams_shard_by_shard(tmp_path):
    pretrain(tmp_path / "big", BIG, 1, "deepseek_v3")
    model_mib = sum(t.numel() * 4 for t in fresh_state(tmp_path / "big" / "run").values()) / 2**20
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "export_rss.py"), tmp_path / "big" / "run",
                        out, "--max_shard_size", f"{SHARD_MB}MB", "--quiet"], env=env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    shards = sorted(out.glob("model-*.safetensors"))
    print(f"\nexport of a {model_mib:.0f} MiB model in {len(shards)} shards of <= {SHARD_MB} MB: peak RSS "
          f"{r['imports_mib']:.0f} MiB after imports, {r['planned_mib']:.0f} after planning, {r['peak_mib']:.0f} at "
          "the end")
    assert model_mib > 400 and len(shards) > 15
    assert sum(f.stat().st_size for f in shards) > model_mib * 2**20
    # Measured (2-core CPU machine, 437 MiB model, one 1.3 GB optimizer file): 246 MiB after imports, 392 after
    # planning, 457 at the end. Planning costs ~146 MiB whatever the model's size (the tokenizer, transformers'
    # modeling modules, the model on the meta device); reading the weights there would add the model's 437 MiB.
    # Writing adds ~65 MiB for 20 MB shards (~177 MiB for 100 MB ones): the shard's tensors, safetensors' bytes
    # copy of them and the mapped input pieces; holding the whole model (one 2GB shard) adds 875 MiB.
    assert r["planned_mib"] - r["imports_mib"] < 0.5 * model_mib, (r, model_mib)
    assert r["peak_mib"] - r["planned_mib"] < 0.25 * model_mib, (r, model_mib)


# ----------------------------------------------------------------------------------------------- bad input


def copy_checkpoint(run: Path, to: Path) -> Path:
    """A copy of the run's latest checkpoint, as RUN/checkpoints/<tag> + latest, for corrupting."""
    src = run / "checkpoints"
    tag = (src / "latest").read_text().strip()
    shutil.copytree(src / tag, to / "checkpoints" / tag)
    (to / "checkpoints" / "latest").write_text(tag)
    return to / "checkpoints" / tag


def reseal(tag: Path) -> None:
    """Rewrite the copy's manifest.json for its files as they are now (as a save of them would have written it)."""
    from engine.checkpoint import MANIFEST, manifest

    (tag / MANIFEST).write_text(json.dumps({"tag": tag.name, "files": manifest(tag)}))


def refused(p: subprocess.CompletedProcess, *words) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def existing_output(tmp_path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    return out


def untouched(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temp dir left


def test_missing_checkpoint_dir(tmp_path):
    """Through a fresh process: the one line is all it writes to stderr (no import-time warning)."""
    p = zero_to_fp32_process(tmp_path / "nope", tmp_path / "out")
    refused(p, "no such directory")
    assert not (tmp_path / "out").exists()


def test_unknown_tag(deepseek2, existing_output):
    refused(zero_to_fp32(deepseek2["run"], existing_output, "--tag", "step_99999999", "--force"),
            "step_99999999", "step_00000003")
    untouched(existing_output)


def test_non_empty_output_needs_force(deepseek2, existing_output):
    refused(zero_to_fp32(deepseek2["run"], existing_output), "not empty", "--force")
    untouched(existing_output)
    export_ok(deepseek2["run"], existing_output, "--force", "--max_shard_size", "100KB")
    assert not (existing_output / "keep.txt").exists() and (existing_output / "config.json").is_file()


@pytest.mark.parametrize("which", ["optim", "model"])
def test_truncated_shard(deepseek2, existing_output, tmp_path, which):
    tag = copy_checkpoint(deepseek2["run"], tmp_path / "copy")
    f = tag / f"zero_pp_rank_1_mp_rank_00_{which}_states.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    refused(zero_to_fp32(tmp_path / "copy", existing_output, "--force"), f.name, "truncated or corrupt")
    untouched(existing_output)


@pytest.mark.parametrize("which", ["optim", "model"])
def test_flipped_byte_in_a_shard(deepseek2, existing_output, tmp_path, which):
    """Same size, still a readable torch file: only the manifest's zip CRCs (engine/checkpoint.py) catch it."""
    from engine.export.read import load

    tag = copy_checkpoint(deepseek2["run"], tmp_path / "copy")
    f = tag / f"zero_pp_rank_1_mp_rank_00_{which}_states.pt"
    size = f.stat().st_size
    flip_byte(f)
    assert f.stat().st_size == size
    load(f)  # torch.load reads the flipped value without complaint
    refused(zero_to_fp32(tmp_path / "copy", existing_output, "--force"), f.name, "CRC", "truncated or corrupt")
    untouched(existing_output)


def flip_byte(f: Path) -> None:
    """Invert one byte in the middle of the file's largest tensor storage (a zip entry under data/)."""
    import struct
    import zipfile

    with zipfile.ZipFile(f) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(f.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF  # past the local header
    f.write_bytes(bytes(data))


class Payload:
    """Pickles as a call of os.system: unpickling it without weights_only would run the command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("which", ["optim", "model"])
def test_foreign_pickled_global_is_never_run(deepseek2, existing_output, tmp_path, which):
    tag = copy_checkpoint(deepseek2["run"], tmp_path / "copy")
    f = tag / f"zero_pp_rank_1_mp_rank_00_{which}_states.pt"
    marker = tmp_path / "payload_ran"
    sd = torch.load(f, weights_only=False)  # our own test's file
    sd["extra"] = Payload(f"touch {marker}")
    torch.save(sd, f)
    reseal(tag)  # a consistent checkpoint, so the refusal is the unpickling's and not the manifest's
    refused(zero_to_fp32(tmp_path / "copy", existing_output, "--force"), f.name, "posix.system", "refusing to unpickle")
    assert not marker.exists()
    untouched(existing_output)


def test_missing_rank_file(deepseek2, existing_output, tmp_path):
    tag = copy_checkpoint(deepseek2["run"], tmp_path / "copy")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(zero_to_fp32(tmp_path / "copy", existing_output, "--force"), "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    untouched(existing_output)


@pytest.mark.parametrize("run", ["deepseek2", "zero2"])  # the ZeRO-3 and the ZeRO-1/2 reader
def test_shapes_that_do_not_match_the_recorded_config(run, existing_output, tmp_path, request):
    tag = copy_checkpoint(request.getfixturevalue(run)["run"], tmp_path / "copy")
    state = json.loads((tag / "engine_state.json").read_text())
    state["recipe"]["model"]["moe_intermediate_size"] = 40
    (tag / "engine_state.json").write_text(json.dumps(state))
    reseal(tag)  # not damaged: a consistent checkpoint whose recorded config is not the one its shards have
    refused(zero_to_fp32(tag, existing_output, "--force"), "does not match", "gate_up_proj")
    untouched(existing_output)


def test_zero12_missing_optimizer_file(zero2, existing_output, tmp_path):
    """A ZeRO-2 checkpoint without rank 1's optimizer file, its manifest rewritten to match (so the refusal is the
    ZeRO-1/2 reader's own, not the manifest's)."""
    tag = copy_checkpoint(zero2["run"], tmp_path / "copy")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    reseal(tag)
    refused(zero_to_fp32(tmp_path / "copy", existing_output, "--force"), "2 data-parallel ranks",
            "optimizer files of ranks [1] are missing")
    untouched(existing_output)
