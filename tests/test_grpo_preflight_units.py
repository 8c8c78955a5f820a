"""engine/grpo.py's checks before any rank works, one rule at a time in this process (no launcher, no engine): the
command line, the prompt files, which model a run starts or resumes from, the local decoder's bytes and families,
the loss fields handed to the math module, preflight's refusals and what it resolves, and the small helpers that
pick positions, devices and rollout kinds. Each case was a change to the code that every fast test let through."""
import json
import zipfile
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, save_tiny_hf

ASSETS = ROOT / "engine" / "assets"
TINY = ROOT / "engine" / "recipes" / "grpo_tiny.yaml"
DS_16x4 = ROOT / "tests" / "zero3_grpo_16x4.json"  # 16 x 4 = 64 sequences per rank, written


def tok():
    from engine.data import load_tokenizer

    return load_tokenizer(str(ASSETS / "tokenizer"))


def write_recipe(tmp_path, grpo: dict | None = None, train: dict | None = None, model: dict | None = None,
                 data: dict | None = None, name: str = "r.yaml"):
    """grpo_tiny.yaml with absolute asset paths and a random init allowed, its sections updated with the dicts."""
    import yaml

    r = yaml.safe_load(TINY.read_text().replace("engine/assets/", f"{ASSETS}/"))
    r["grpo"]["allow_random_init"] = True
    for section, changes in (("grpo", grpo), ("train", train), ("model", model), ("data", data)):
        r[section].update(changes or {})
    (tmp_path / name).write_text(yaml.safe_dump(r))
    return tmp_path / name


def run_preflight(tmp_path, *argv, ds=DS_16x4, world=None, **recipe):
    from engine.grpo import parse_args, preflight
    from engine.parallel import World

    args = parse_args(["--deepspeed_config", str(ds), "--config", str(write_recipe(tmp_path, **recipe)),
                       "--run_dir", str(tmp_path / "run"), *map(str, argv)])
    return preflight(args, world or World(rank=0, size=1, local_size=1))


def refusal(tmp_path, *argv, **kw) -> str:
    from engine.config import ConfigError

    with pytest.raises(ConfigError) as e:
        run_preflight(tmp_path, *argv, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fake_checkpoint(run_dir, state: dict | None = None, tag: str = "step_00000002"):
    """run_dir/checkpoints/<tag> named by `latest`, with an (empty) model-states file and `state` as its
    engine_state.json."""
    d = run_dir / "checkpoints" / tag
    d.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"")
    if state is not None:
        (d / "engine_state.json").write_text(json.dumps(state))
    return d


def hf_dir(path, **changes):
    from engine.config import ModelConfig
    from engine.model import make_hf_config

    cfg = make_hf_config(ModelConfig(**changes))
    cfg.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------ command line and prompts

def test_max_steps_from_the_command_line_is_an_integer():
    """--max_steps is read as an int (it bounds --profile_step and the step loop). [fails if: the option is read as
    a string]"""
    from engine.grpo import parse_args

    args = parse_args(["--deepspeed_config", "x.json", "--max_steps", "5"])
    assert args.max_steps == 5 and isinstance(args.max_steps, int)


def test_a_prompts_file_without_an_answer_column_is_one_config_error(tmp_path, monkeypatch):
    """A prompts file whose rows are longer than the checked head and have no `answer` at all: one ConfigError that
    names the missing column and the columns there are. [fails if: the column check after loading is dropped (a
    KeyError from the first row instead)]"""
    from engine import data_check
    from engine.config import ConfigError
    from engine.grpo import load_prompts

    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 256)
    f = jsonl(tmp_path / "p.jsonl", [{"prompt": f"Q: {i} + 1 = ? A:" + " x" * 200} for i in range(5)])
    with pytest.raises(ConfigError, match=r"^grpo.eval_path .*p.jsonl: needs an `answer` column next to `prompt` "
                                          r"\(columns: \['prompt'\]\)$"):
        load_prompts(str(f), "grpo.eval_path")


# ----------------------------------------------------------------------------------- which model a run starts from

def resuming(run_dir):
    from engine.config import Recipe

    return replace(Recipe(), run_dir=str(run_dir), resume=True)


def test_a_resumed_run_starts_from_the_model_its_checkpoint_records(tmp_path):
    """On --resume the reference is rebuilt from the model the run started from: with no --init_from that recorded
    model; with --init_from the same dir (another spelling of it) the same; without --resume whatever was given.
    [fails if: the given --init_from (None) is returned instead of the recorded model, or the same source spelled
    differently is refused (the path comparison inverted)]"""
    from engine.grpo import resumed_init

    start = hf_dir(tmp_path / "hf")
    run = tmp_path / "run"
    fake_checkpoint(run, {"recipe": {"model": {"init_from": str(start)}}, "init_source": str(start)})
    assert resumed_init(None, resuming(run)) == (str(start), None)
    assert resumed_init(str(tmp_path / "." / "hf"), resuming(run)) == (str(start), None)
    assert resumed_init("elsewhere", replace(resuming(run), resume=False)) == ("elsewhere", None)


def test_a_resumed_run_refuses_another_source_and_a_missing_start(tmp_path):
    """--resume with --init_from naming another model than the recorded source, or with --init_from for a run that
    started from a random init, is refused naming the run and the checkpoint; a recorded start dir that is gone is
    refused too; a random-init run resumed without --init_from stays random. [fails if: another source is accepted,
    a random-init run takes an --init_from, or a vanished start dir is not reported]"""
    from engine.grpo import resumed_init

    start, other = hf_dir(tmp_path / "hf"), hf_dir(tmp_path / "other")
    run = tmp_path / "run"
    d = fake_checkpoint(run, {"recipe": {"model": {"init_from": str(start)}}, "init_source": str(start)})
    init, problem = resumed_init(str(other), resuming(run))
    assert init is None and problem.startswith(f"--init_from {other}: the run in {run} started from {start} "
                                               f"(checkpoint {d}), its reference policy")
    (start / "config.json").unlink()
    init, problem = resumed_init(None, resuming(run))
    assert init is None and f"--resume: the run started from {start} (checkpoint {d}), which is gone" in problem

    rnd = tmp_path / "rnd"
    d = fake_checkpoint(rnd, {"recipe": {"model": {"init_from": None}}})
    assert resumed_init(None, resuming(rnd)) == (None, None)
    init, problem = resumed_init(str(other), resuming(rnd))
    assert init is None and problem.startswith(f"--init_from {other}: the run in {rnd} started from a random init "
                                               f"(checkpoint {d})")


def test_resolve_init_takes_the_recipe_model_a_hf_dir_or_a_checkpoint(tmp_path):
    """resolve_init: no --init_from gives model.init_from; a Hugging Face dir is used as given; a DeepSpeed
    checkpoint gives None (main() exports it); a missing path and a dir that is neither are refused, differently.
    [fails if: model.init_from is ignored, a checkpoint is returned as if it were a model dir, or the missing-path
    message is lost]"""
    from engine.config import ConfigError, Recipe
    from engine.grpo import resolve_init

    r = Recipe()
    assert resolve_init(None, replace(r, model=replace(r.model, init_from="/models/x"))) == "/models/x"
    assert resolve_init(str(hf_dir(tmp_path / "hf")), r) == str(tmp_path / "hf")
    fake_checkpoint(tmp_path / "run")
    assert resolve_init(str(tmp_path / "run"), r) is None
    with pytest.raises(ConfigError, match=r"^--init_from /nonexistent/x: no such directory"):
        resolve_init("/nonexistent/x", r)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"neither a Hugging Face model dir \(no config.json\) nor a checkpoint"):
        resolve_init(str(tmp_path / "empty"), r)


def test_model_config_is_the_loaded_models_and_a_damaged_checkpoint_is_refused(tmp_path):
    """model_config: a Hugging Face dir's own config (not the recipe's model section); a checkpoint with a file
    shorter than saved, or a zip entry whose CRC fails (its size unchanged), is refused as damaged before any rank
    reads it. [fails if: the recipe's model is planned instead of the loaded one, the damage check is dropped, or
    the CRCs are not verified]"""
    from engine.config import ConfigError, Recipe
    from engine.grpo import model_config

    r = Recipe()
    cfg = model_config(None, str(hf_dir(tmp_path / "hf", hidden_size=96)), r, tok())
    assert cfg.hidden_size == 96 != r.model.hidden_size

    d = fake_checkpoint(tmp_path / "run")
    with zipfile.ZipFile(d / "mp_rank_00_model_states.pt", "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"0123456789" * 50)
    raw = (d / "mp_rank_00_model_states.pt").read_bytes()
    at = raw.index(b"0123456789") + 7
    (d / "mp_rank_00_model_states.pt").write_bytes(raw[:at] + b"X" + raw[at + 1:])  # same size, wrong CRC
    with pytest.raises(ConfigError) as e:
        model_config(str(tmp_path / "run"), None, r, tok())
    assert f"checkpoint {d.resolve()} is damaged (mp_rank_00_model_states.pt fails its CRC check in entry " \
           "archive/data.pkl)" in str(e.value)
    (d / "manifest.json").write_text(json.dumps({"files": {"mp_rank_00_model_states.pt": {"size": len(raw) + 1}}}))
    with pytest.raises(ConfigError, match=rf"is damaged \(mp_rank_00_model_states.pt has {len(raw)} bytes, "
                                          rf"{len(raw) + 1} when saved\)"):
        model_config(str(tmp_path / "run"), None, r, tok())


# ------------------------------------------------------------------------------------------- the local decoder

@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_decoders_kv_cache_is_k_and_v_of_each_kv_head(arch):
    """decoder_bytes for grouped-query attention: weights are every parameter x the dtype's size; the cache holds K
    and V for num_key_value_heads heads of head_dim (an explicit head_dim wins over hidden_size / heads) per layer,
    sequence and slot. [fails if: the factor 2 (K and V), the KV heads (not the query heads), the explicit head_dim
    or the layer count is lost]"""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.grpo import decoder_bytes
    from engine.model import make_hf_config

    cfg = make_hf_config(ModelConfig(arch=arch, num_heads=4, num_kv_heads=2, num_layers=3))
    cfg.head_dim = 24  # not hidden_size / num_heads (16)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    weights, cache = decoder_bytes(cfg, torch.bfloat16, 5, 7)
    assert cfg.num_key_value_heads == 2 and cfg.num_attention_heads == 4
    assert weights == 2 * n and cache == 3 * 5 * 7 * (2 * 2 * 24) * 2


def test_the_decoders_mla_cache_is_one_latent_and_one_rope_key_per_token():
    """decoder_bytes for multi-head latent attention (deepseek_v3): per layer, sequence and slot the cache holds the
    compressed KV latent (kv_lora_rank) and the decoupled RoPE key (qk_rope_head_dim), shared by every head, not K
    and V per head. [fails if: the RoPE key part is dropped, or MLA is sized as K and V of each KV head]"""
    from engine.config import ModelConfig
    from engine.grpo import decoder_bytes
    from engine.model import make_hf_config

    cfg = make_hf_config(ModelConfig(arch="deepseek_v3", num_layers=3, kv_lora_rank=40, qk_rope_head_dim=12))
    assert cfg.kv_lora_rank == 40 and cfg.qk_rope_head_dim == 12 and cfg.num_hidden_layers == 3
    _, cache = decoder_bytes(cfg, torch.bfloat16, 5, 7)
    assert cache == 3 * 5 * 7 * (40 + 12) * 2


# ------------------------------------------------------------------------------------------- the loss fields

def test_loss_config_hands_every_loss_field_over_as_set():
    """loss_config copies each loss field of grpo: (values unlike the defaults) into the math module's config.
    [fails if: a field is dropped (its default used) or two are swapped]"""
    from engine.config import GRPOConfig
    from engine.grpo import loss_config
    from engine.grpo_math import GRPOLossConfig

    g = GRPOConfig(clip_low=0.1, clip_high=0.35, beta=0.02, kl="k1", aggregation="dapo", normalize_std=False,
                   max_new_tokens=13, rollout_correction="mis", rollout_correction_cap=3.5)
    assert loss_config(g) == GRPOLossConfig(clip_low=0.1, clip_high=0.35, beta=0.02, kl="k1", aggregation="dapo",
                                            normalize_std=False, max_new_tokens=13, rollout_correction="mis",
                                            rollout_correction_cap=3.5)


# ------------------------------------------------------------------------------------------------- preflight

def test_preflight_refuses_fp8_training_in_grpo(tmp_path):
    """train.fp8 is pretraining's: GRPO refuses it, naming the setting and its value. [fails if: the fp8 check is
    dropped]"""
    line = refusal(tmp_path, train={"fp8": "dense"})
    assert "train.fp8 (dense): bin/pretrain.py only so far; GRPO trains in the DS config's precision" in line


def test_profile_step_must_be_a_step_of_the_run(tmp_path):
    """--profile_step N runs step N of 1..max_steps under the profiler: 1 and max_steps are accepted, 0 and
    max_steps + 1 refused with the range. [fails if: the range check is dropped or either bound is off by one]"""
    assert run_preflight(tmp_path, "--max_steps", 3, "--profile_step", 3)[0].train.max_steps == 3
    run_preflight(tmp_path, "--max_steps", 3, "--profile_step", 1)
    for bad in (0, 4):
        assert f"--profile_step {bad}: must be a step of this run (1..3)" in refusal(
            tmp_path, "--max_steps", 3, "--profile_step", bad)


def test_a_bad_peer_timeout_is_refused_in_preflight(tmp_path, monkeypatch):
    """$MOE_PEER_TIMEOUT is input like the recipe: a value that is not seconds is one of preflight's problems.
    [fails if: the watchdog's error is swallowed in preflight]"""
    monkeypatch.setenv("MOE_PEER_TIMEOUT", "soon")
    assert "MOE_PEER_TIMEOUT='soon': expected seconds from 0" in refusal(tmp_path)


def test_a_trees_leaves_become_the_group_and_must_divide_the_batch(tmp_path):
    """grpo.tree on: the recipe handed on has group_size = the tree's leaves (4 x (1 + 3) = 16 of a 64 batch), and
    leaves that do not divide the rank's batch (5 x 4 = 20) are refused. [fails if: group_size is left at the
    recipe's 8, or the tree's problems are not added]"""
    recipe = run_preflight(tmp_path, grpo={"tree": {"enabled": True, "trees": 4, "branches": 3}})[0]
    assert recipe.grpo.group_size == 16 and recipe.grpo.tree.leaves() == 16
    line = refusal(tmp_path, grpo={"tree": {"enabled": True, "trees": 5, "branches": 3}})
    assert "grpo.tree: 5 trees x (1 + 1 iterations x 1 branch_points x 3 branches) = 20 leaves per prompt must " \
           "divide train_micro_batch_size_per_gpu x gradient_accumulation_steps (64)" in line


def test_a_resume_refusal_keeps_the_problems_found_before_it(tmp_path):
    """A --resume whose --init_from contradicts the checkpoint stops preflight at once, in one line with every
    problem found before it. [fails if: the earlier problems are dropped from that line]"""
    fake_checkpoint(tmp_path / "run", {"recipe": {"model": {"init_from": None}}})
    hf = hf_dir(tmp_path / "hf")
    line = refusal(tmp_path, "--resume", "--init_from", hf, train={"balance_rate": 0.01})
    assert line.startswith("train.balance_rate (0.01): GRPO keeps the routing biases")
    assert f"; --init_from {hf}: the run in {tmp_path / 'run'} started from a random init" in line


def test_a_checkpoint_init_from_is_not_a_random_init(tmp_path, monkeypatch):
    """--init_from a DeepSpeed checkpoint resolves to no HF dir yet (main() exports it): that is a real policy, not
    the random init that needs grpo.allow_random_init. [fails if: the random-init refusal looks only at the resolved
    HF dir]"""
    import engine.grpo as grpo
    from engine.model import make_hf_config

    monkeypatch.setattr(grpo, "model_config", lambda init_from, init, recipe, tok: make_hf_config(recipe.model, tok))
    fake_checkpoint(tmp_path / "pre")
    out = run_preflight(tmp_path, "--init_from", tmp_path / "pre", grpo={"allow_random_init": False})
    assert out[-1] is None
    assert "no --init_from (nor model.init_from)" in refusal(tmp_path, grpo={"allow_random_init": False})


def test_the_context_check_counts_prompt_plus_new_tokens_once_per_file(tmp_path):
    """A prompt of n tokens fits the 512-token context with max_new_tokens 512 - n, not with one more; a file with
    several such rows gets one message (its first), each file its own; every row records its token count.
    [fails if: the comparison is >=, max_new_tokens is left out, every row is reported, or n_tokens is not
    recorded]"""
    p = "Gus went to the harbor with 9 pens. " * 8 + "Q: 10 + 20 = ? A:"
    f = jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": "30"}] * 3)
    n = len(tok()(p)["input_ids"])
    rows = run_preflight(tmp_path, data={"path": str(f)}, grpo={"eval_path": str(f), "max_new_tokens": 512 - n})[3]
    assert [r["n_tokens"] for r in rows] == [n] * 3
    line = refusal(tmp_path, data={"path": str(f)}, grpo={"eval_path": str(f), "max_new_tokens": 513 - n})
    want = f"row 1: prompt of {n} tokens + grpo.max_new_tokens {513 - n} exceeds the context (512)"
    assert line.count("row ") == 2 and f"data.path {want}" in line and f"grpo.eval_path {want}" in line


def test_routing_replay_is_accepted_on_an_moe_model(tmp_path):
    """grpo.routing_replay r3 on the tiny MoE passes preflight unchanged (its refusal is for models without an MoE
    layer). [fails if: the MoE test is inverted]"""
    assert run_preflight(tmp_path, grpo={"routing_replay": "r3"})[0].grpo.routing_replay == "r3"


GDN = {"arch": "qwen3_5_moe", "num_layers": 4, "num_kv_heads": 2}  # Gated DeltaNet: not the local decoder's family


def test_a_family_the_decoder_cannot_take_rolls_out_through_the_engine_unless_a_setting_needs_the_decoder(
        tmp_path, capsys):
    """A Qwen3.5-MoE (Gated DeltaNet) model: grpo.rollout auto becomes engine with a note; with a setting only the
    local decoder does (min_new_tokens, rollout_correction) it is refused naming that setting. [fails if: auto is
    not switched to engine, or a setting that needs the local decoder is not refused]"""
    recipe = run_preflight(tmp_path, model=GDN)[0]
    assert recipe.grpo.rollout == "engine" and "grpo.rollout auto picks engine" in capsys.readouterr().out
    line = refusal(tmp_path, model=GDN, grpo={"min_new_tokens": 2})
    assert "cannot take a qwen3_5_moe_text model" in line and line.endswith(
        "(grpo.min_new_tokens needs the local decoder)")
    line = refusal(tmp_path, model=GDN, grpo={"rollout_correction": "tis"})
    assert line.endswith("(grpo.rollout_correction tis needs the local decoder)")


def test_triton_decode_attention_is_checked_only_where_the_local_decoder_runs(tmp_path):
    """grpo.decode_attention triton concerns the local decoder: refused on a CPU run that uses it, not looked at
    with grpo.rollout engine. [fails if: the check runs for the engine rollout instead]"""
    assert run_preflight(tmp_path, grpo={"decode_attention": "triton", "rollout": "engine"})[0].grpo.rollout == "engine"
    assert "grpo.decode_attention: triton runs on CUDA devices only" in refusal(
        tmp_path, grpo={"decode_attention": "triton", "rollout": "local"})


def test_the_decoder_fit_counts_the_ranks_whole_rollout_batch(tmp_path, monkeypatch, capsys):
    """On a GPU the local decoder must fit with the KV cache of all 64 sequences of the rank: on a device where the
    weights and one sequence's cache (even at the full context) fit but 64 sequences' do not, rollout local is
    refused naming 64 sequences, and auto picks engine. [fails if: the fit is checked for fewer sequences, or auto
    keeps the local decoder]"""
    import engine.grpo as grpo
    from engine.config import load_recipe
    from engine.model import make_hf_config

    cfg = make_hf_config(load_recipe(TINY).model, tok())
    weights, cache1 = grpo.decoder_bytes(cfg, torch.bfloat16, 1, 512)
    monkeypatch.setattr(grpo, "device_kind", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=2 * (weights + cache1)))
    line = refusal(tmp_path, grpo={"rollout": "local"})
    assert line.startswith("grpo.rollout: local keeps a whole copy of the model on every device") and \
        "KV cache for 64 sequences x " in line
    capsys.readouterr()
    assert run_preflight(tmp_path)[0].grpo.rollout == "engine"
    assert "grpo.rollout auto picks engine" in capsys.readouterr().out


def test_triton_decode_attention_is_not_refused_where_the_fit_picks_the_engine(tmp_path, monkeypatch, capsys):
    """On a GPU where the local decoder does not fit, grpo.rollout auto picks the engine: grpo.decode_attention
    triton, which only the local decoder reads, is then not checked (here: a machine without the triton package),
    while grpo.rollout local is refused for the fit. [fails if: the triton check runs before the fit has picked the
    engine]"""
    import engine.grpo as grpo
    import engine.mla_decode as mla_decode

    monkeypatch.setattr(grpo, "device_kind", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=2**20))
    monkeypatch.setattr(mla_decode, "available", lambda: False)
    recipe = run_preflight(tmp_path, grpo={"decode_attention": "triton"})[0]
    assert recipe.grpo.rollout == "engine" and "grpo.rollout auto picks engine" in capsys.readouterr().out
    assert "needs the triton package" in refusal(tmp_path, grpo={"decode_attention": "triton", "rollout": "local"})


def test_preflight_checks_the_run_dir_and_a_resume_has_something_to_resume(tmp_path):
    """A run_dir that is a file is refused; --resume on a run_dir without checkpoints is refused (preflight passes
    --resume on to the recipe). [fails if: run_dir's problems are not added, or --resume does not reach the
    recipe]"""
    run_preflight(tmp_path)
    assert refusal(tmp_path, "--resume") == (f"--resume: no checkpoint in {tmp_path / 'run' / 'checkpoints'} (run "
                                             "without --resume to start fresh)")
    (tmp_path / "run").write_text("")
    assert f"run_dir {tmp_path / 'run'}: {tmp_path / 'run'} is a file, not a folder" in refusal(tmp_path)


def test_a_resume_with_the_curriculum_checks_its_statistics_against_the_prompts(tmp_path):
    """--resume with grpo.curriculum on: the checkpoint's statistics are for 5 prompts and data.path now holds 3, so
    preflight refuses, naming both counts (whatever else check_resume finds in the fake checkpoint). [fails if:
    preflight does not ask curriculum.resume_problems]"""
    prompts = jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(3)])
    stats = {"n_prompts": 5, "attempts": [1.0] * 5, "passes": [0.0] * 5, "reward_sum": [0.5] * 5}
    fake_checkpoint(tmp_path / "run", {"step": 2, "position": 0, "tokens": 0, "curriculum": stats,
                                       "recipe": {"model": {"init_from": None}}})
    line = refusal(tmp_path, "--resume", grpo={"curriculum": {"enabled": True}}, data={"path": str(prompts)})
    assert ("--resume: the checkpoint's grpo.curriculum statistics are for 5 prompts but data.path has 3; resume "
            "with the prompts file the run started with") in line, line


def test_offload_that_the_hosts_memory_cannot_hold_is_refused(tmp_path, monkeypatch):
    """ZeRO-3 offload keeps optimizer state in host memory: when the node has less available than the ranks would
    keep, preflight refuses naming the DS config. [fails if: the host-memory problem is not added]"""
    import engine.auto_batch as ab

    ds = ROOT / "ds_configs" / "zero3_offload.json"
    monkeypatch.setattr(ab, "host_available_gib", lambda: 1e-6)
    line = refusal(tmp_path, ds=ds)
    assert line.startswith(f"DeepSpeed config {ds}: zero_optimization offload: the 1 rank of this node would keep ")
    monkeypatch.setattr(ab, "host_available_gib", lambda: 1e6)
    assert run_preflight(tmp_path, ds=ds)[1]["train_micro_batch_size_per_gpu"] >= 1


def test_an_auto_batch_resume_with_another_batch_is_refused(tmp_path):
    """--resume with an "auto" DS batch keeps the checkpoint's micro-batch and accumulation (8 x 4 = 32 here) for an
    exact resume; when the recipe now asks for another rollout batch (64) preflight refuses naming both. [fails if:
    the kept and asked-for batches are not compared]"""
    fake_checkpoint(tmp_path / "run", {"recipe": {"model": {"init_from": None}}, "micro_batch": 8, "grad_accum": 4})
    line = refusal(tmp_path, "--resume", ds=ROOT / "ds_configs" / "zero3_grpo.json")
    assert '"auto" kept the checkpoint\'s batch (8 x 4 = 32 sequences per GPU) for an exact resume, but the recipe ' \
           "now asks for 64 (8 prompts x 8 completions; default: 64 // 8 prompts)" in line


def test_the_auto_batch_counts_a_zero3_references_shard_and_a_whole_copy_otherwise(tmp_path):
    """grpo_auto_batch's memory beside the policy (rollout engine: the reference only): under ZeRO-3 each of 2 ranks
    holds half the reference's bytes, under ZeRO-2 a whole copy on every rank; on one rank both are the whole
    model. [fails if: the ZeRO-3 reference is counted whole on every rank]"""
    from engine.config import load_recipe
    from engine.grpo import grpo_auto_batch
    from engine.model import make_hf_config
    from engine.parallel import World

    r = load_recipe(TINY)
    r = replace(r, grpo=replace(r.grpo, rollout="engine"), run_dir=str(tmp_path / "run"))
    cfg = make_hf_config(r.model, tok())
    z3, z2 = (json.loads((ROOT / "ds_configs" / f"{n}.json").read_text()) for n in ("zero3_grpo", "zero2_grpo"))

    def extra(raw, n):
        world = World(rank=0, size=n, local_size=n)
        return grpo_auto_batch((64, "x"), raw, r, cfg, [{"n_tokens": 10}], world).extra_gib

    whole = extra(z3, 1)
    assert whole > 0 and extra(z2, 1) == pytest.approx(whole) and extra(z2, 2) == pytest.approx(whole)
    assert extra(z3, 2) == pytest.approx(whole / 2)


# ---------------------------------------------------------------------------------------------- small helpers

def test_forward_logps_passes_positions_of_the_left_padded_rows_and_the_sampling_temperature():
    """forward_logps asks the engine for ids[:, 1:]'s log-probs at the given temperature, with positions that start
    at 0 on each row's first real token (left padding: pads at 0), and passes with_entropy on. [fails if: positions
    are not shifted by one, the temperature or with_entropy is not passed]"""
    from engine.grpo import forward_logps

    seen = {}

    def engine(**kw):
        seen.update(kw)
        return SimpleNamespace(logprobs="lp", entropy="ent")

    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert forward_logps(engine, ids, attn, 0.7, with_entropy=True) == ("lp", "ent")
    assert seen["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert seen["temperature"] == 0.7 and seen["with_entropy"] is True and seen["use_cache"] is False
    assert torch.equal(seen["logprob_targets"], ids[:, 1:]) and seen["attention_mask"] is attn


def test_where_models_are_built_and_which_rollout_runs():
    """_build_device: ZeRO-3's zero.Init places a new model (None), ZeRO 0-2 build on this rank's device;
    rollout_kind: auto means the local decoder, an explicit kind stays. [fails if: the stages are swapped, or auto
    means engine]"""
    from engine.config import Recipe
    from engine.grpo import _build_device, rollout_kind

    assert _build_device({"zero_optimization": {"stage": 3}}) is None
    assert _build_device({"zero_optimization": {"stage": 2}}) == "cpu"
    r = Recipe()
    assert [rollout_kind(replace(r, grpo=replace(r.grpo, rollout=k))) for k in ("auto", "local", "engine")] == \
        ["local", "local", "engine"]


def test_an_auto_rollout_batch_is_whole_groups_of_at_least_one_prompt():
    """grpo_batch with both batch values "auto": grpo.prompts_per_step_per_gpu x the group (3 x 4 = 12 sequences),
    else 64 // G prompts, and one prompt when a group alone is larger than 64 (80 completions); a tree's leaves are
    named as such. [fails if: prompts_per_step_per_gpu is not multiplied by the group, or a group larger than 64
    gives 0 prompts]"""
    from engine.config import GRPOConfig, TreeConfig
    from engine.grpo import grpo_batch

    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    assert grpo_batch(auto, GRPOConfig(group_size=4, prompts_per_step_per_gpu=3), "x") == (
        12, "grpo.prompts_per_step_per_gpu 3 x 4 completions")
    assert grpo_batch(auto, GRPOConfig(group_size=80), "x") == (80, "1 prompt x 80 completions; default: 64 // 80 "
                                                                    "prompts, at least 1")
    tree = GRPOConfig(tree=TreeConfig(enabled=True, trees=2, branches=3))
    assert grpo_batch(auto, tree, "x") == (64, "8 prompts x 8 tree leaves; default: 64 // 8 prompts")
    assert grpo_batch({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, tree, "x") is None


def test_a_tokenizer_larger_than_the_policys_vocabulary_is_refused(tmp_path):
    """--init_from a Hugging Face model of 480 embeddings with the bundled 483-token tokenizer: one line naming the
    policy and the fix; a model of 483 passes. [fails if: GRPO does not compare the tokenizer with the loaded
    policy's vocabulary]"""
    for vocab in (480, 483):
        hf = save_tiny_hf(tmp_path / f"hf{vocab}", vocab)
        if vocab == 483:
            assert run_preflight(tmp_path, "--init_from", hf)[-1] == str(hf)
            continue
        line = refusal(tmp_path, "--init_from", hf)
        assert f"has 483 tokens but the policy --init_from {hf} has a vocabulary of 480" in line, line


def test_grpo_takes_the_tokenizer_saved_with_its_init_from(tmp_path):
    """data.tokenizer auto (the default) with --init_from a Hugging Face directory that holds its own tokenizer (490
    tokens: the bundled 483 and 7 more) loads that one; a tokenizer named in the recipe stays; a directory without
    one leaves the bundled tokenizer. [fails if: auto ignores --init_from's tokenizer (483 tokens), or overrides a
    named one]"""
    hf = save_tiny_hf(tmp_path / "hf", 490, tokenizer=True)
    r, _, tok, *_ = run_preflight(tmp_path, "--init_from", hf)
    assert (r.data.tokenizer, len(tok)) == (str(hf), 490)
    r, _, tok, *_ = run_preflight(tmp_path, "--init_from", hf, data={"tokenizer": str(ASSETS / "tokenizer")})
    assert (r.data.tokenizer, len(tok)) == (str(ASSETS / "tokenizer"), 483)
    r, _, tok, *_ = run_preflight(tmp_path, "--init_from", save_tiny_hf(tmp_path / "bare", 490))
    assert (r.data.tokenizer, len(tok)) == ("auto", 483)


def test_a_resumed_grpo_run_keeps_the_tokenizer_it_recorded(tmp_path):
    """data.tokenizer auto on --resume: the tokenizer path the checkpoint recorded at the start (the run goes on with
    what it trained with, and the resume reports no data change), while it is there; gone, the one saved with the
    model the run restarts from; without a checkpoint, --init_from's. [fails if: a resume re-resolves from the start
    model when the recorded tokenizer is there (another path, a spurious "another data section" warning)]"""
    from engine.grpo import auto_tokenizer

    hf = save_tiny_hf(tmp_path / "hf", 490, tokenizer=True)
    first = save_tiny_hf(tmp_path / "first", 490, tokenizer=True)  # where the run's tokenizer was found at its start
    run = tmp_path / "run"
    fake_checkpoint(run, {"recipe": {"model": {"init_from": str(hf)}, "data": {"tokenizer": str(first)}}})
    assert auto_tokenizer(resuming(run), str(hf)) == str(first)
    assert auto_tokenizer(replace(resuming(run), resume=False), str(hf)) == str(hf)
    import shutil

    shutil.rmtree(first)
    assert auto_tokenizer(resuming(run), str(hf)) == str(hf)
    assert auto_tokenizer(resuming(run), None) == "auto"


def test_a_resume_from_an_older_checkpoint_says_it_ignores_init_from(tmp_path, capsys):
    """A checkpoint that records the start model but not its source (older runs): --init_from another path is not
    refused (it may be the checkpoint that start was exported from) but no longer dropped silently: one note names
    both; the start's own path gives no note. [fails if: the note is dropped, or printed for the same model]"""
    from engine.grpo import resumed_init

    start = hf_dir(tmp_path / "hf")
    run = tmp_path / "run"
    fake_checkpoint(run, {"recipe": {"model": {"init_from": str(start)}}})
    assert resumed_init(str(tmp_path / "other"), resuming(run)) == (str(start), None)
    out = capsys.readouterr().out
    assert f"note: --init_from {tmp_path / 'other'} is not used" in out and str(start) in out, out
    assert resumed_init(str(start), resuming(run)) == (str(start), None)
    assert "note:" not in capsys.readouterr().out


def test_init_from_decides_the_tokenizer_over_the_recipes_model(tmp_path):
    """A GRPO recipe with model.init_from (its directory holding a 490-token tokenizer) run with --init_from another
    model (495 tokens of its own): data.tokenizer auto takes --init_from's, the model the run starts from; a recipe
    that names model.init_from's tokenizer keeps it. [fails if: auto stays on model.init_from's tokenizer, or a named
    tokenizer is replaced]"""
    recipe_model = save_tiny_hf(tmp_path / "recipe_model", 490, tokenizer=True)
    policy = save_tiny_hf(tmp_path / "policy", 495, tokenizer=True)
    model = {"init_from": str(recipe_model)}
    r, _, tok, *_ = run_preflight(tmp_path, "--init_from", policy, model=model)
    assert (r.data.tokenizer, len(tok)) == (str(policy), 495)
    r, _, tok, *_ = run_preflight(tmp_path, "--init_from", policy, model=model, data={"tokenizer": str(recipe_model)})
    assert (r.data.tokenizer, len(tok)) == (str(recipe_model), 490)
