"""engine/config.py's recipe checks, one rule a test, each a change to config.py (a mutant) that every other fast test
let through: the type check of each field, unknown keys and sections, the bounds validate() holds (each edge taken
and the value past it refused, by its exact line), engine/ and ~ paths, a Hugging Face init_from's config.json
(family, sizes, shared experts, the MLA heads) and its weights (shards, index, cut safetensors), the tree's and the
curricula's ranges. No launcher, no model: config.json files and hand-written safetensors headers."""
import json
import struct
from pathlib import Path

import pytest

from engine.config import (ASSETS, ConfigError, hf_tokenizer, load_recipe, safetensors_problem, weights_problem)


def refused(overrides: dict | None = None, path=None) -> str:
    """The one-line refusal of the tiny recipe (or `path`) with `overrides`."""
    with pytest.raises(ConfigError) as e:
        load_recipe(path, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def safetensors(path: Path, tensors: int = 1, metadata: bool = True) -> int:
    """A whole safetensors file of `tensors` f32 tensors of 4 values (a header and its bytes); returns its size."""
    header = {f"w{i}": {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * (i + 1)]} for i in range(tensors)}
    if metadata:
        header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16 * tensors))
    return path.stat().st_size


def hf_dir(path: Path, arch: str = "deepseek_v3", weights: bool = True, **config) -> Path:
    """A Hugging Face model directory of the tiny `arch` (config.json, its keys updated with `config`; a key set to
    None is written as null) and, with `weights`, a whole model.safetensors."""
    from engine.config import ModelConfig
    from engine.model import make_hf_config

    make_hf_config(ModelConfig(arch=arch)).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    if weights:
        safetensors(path / "model.safetensors")
    return path


# ------------------------------------------------------------------------------------------ types and keys

def test_a_boolean_learning_rate_is_refused():
    """Catches bool accepted as a float (YAML `lr: true` trained at lr 1.0)."""
    assert "train.lr: expected float, got True" in refused({"train.lr": True})


def test_a_nullable_field_still_checks_its_type():
    """Catches `int | None` accepting any value (a string decay_steps crashed validate with a TypeError)."""
    line = refused({"train.decay_steps": "ten", "model.q_lora_rank": 1.5})
    assert "train.decay_steps: expected int | None, got 'ten'" in line
    assert "model.q_lora_rank: expected int | None, got 1.5" in line


def test_a_misspelled_key_is_named_with_the_known_ones():
    """Catches an unknown key silently ignored (a typo trained with the default)."""
    line = refused({"train.max_step": 5})
    assert "train.max_step: unknown key (known: activation_checkpointing, balance_rate, compile," in line


def test_a_problem_in_a_nested_section_names_its_whole_path():
    """Catches a nested section's problems named without their parent (tree.trees instead of grpo.tree.trees)."""
    line = refused({"grpo.tree": {"trees": "two"}, "grpo.curriculum": {"decay": "x"}})
    assert "grpo.tree.trees: expected int, got 'two'" in line
    assert "grpo.curriculum.decay: expected float, got 'x'" in line


def test_a_section_that_is_not_a_mapping_is_refused(tmp_path):
    """Catches a section given as a scalar silently replaced by the defaults."""
    (tmp_path / "r.yaml").write_text("train: 5\n")
    assert refused(path=tmp_path / "r.yaml") == f"recipe {tmp_path / 'r.yaml'}: train: expected a mapping, got int"


def test_an_empty_recipe_file_is_all_defaults(tmp_path):
    """Catches an empty (or comment-only) YAML file refused as 'not a mapping' instead of read as the defaults."""
    for text in ("", "# nothing set yet\n"):
        (tmp_path / "r.yaml").write_text(text)
        r = load_recipe(tmp_path / "r.yaml")
        assert (r.model.arch, r.train.max_steps, r.run_dir) == ("deepseek_v3", 200, "runs/default")


# ------------------------------------------------------------------------------------------ validate's bounds

@pytest.mark.parametrize("name", ["vocab_size", "moe_intermediate_size"])
def test_a_model_size_of_zero_is_refused(name):
    """Catches model sizes checked with `< 0` (a zero-width model accepted)."""
    assert f"model.{name}: must be >= 1, got 0" in refused({f"model.{name}": 0})


def test_heads_must_divide_the_hidden_size_and_kv_heads_the_heads():
    """Catches the hidden_size % num_heads or num_heads % num_kv_heads check dropped."""
    assert "model.hidden_size (60) must be divisible by model.num_heads (8)" in refused(
        {"model.hidden_size": 60, "model.num_heads": 8, "model.num_kv_heads": 8})
    assert "model.num_heads (4) must be divisible by model.num_kv_heads (3)" in refused({"model.num_kv_heads": 3})


def test_dense_first_layers_are_refused_for_a_family_without_them():
    """Catches first_dense_layers accepted for qwen3_moe (transformers builds an MoE block in every layer)."""
    assert "model.first_dense_layers: qwen3_moe is built with an MoE block in every layer" in refused(
        {"model.arch": "qwen3_moe", "model.first_dense_layers": 1, "train.balance_rate": 0.0})


def test_max_steps_zero_is_refused_and_one_taken():
    """Catches train.max_steps checked with `< 0` (a run of no step)."""
    assert "train.max_steps: must be >= 1, got 0" in refused({"train.max_steps": 0})
    assert load_recipe(None, {"train.max_steps": 1}).train.max_steps == 1


def test_each_documented_fp8_value_is_taken_and_true_refused():
    """Catches train.fp8 all (or dense) refused, or an undocumented value let through."""
    for value in (False, "dense", "all"):
        assert load_recipe(None, {"train.fp8": value}).train.fp8 == value
    assert "train.fp8: True is not one of false, dense, all" in refused({"train.fp8": True})


def test_a_misspelled_stochastic_rounding_is_refused():
    """Catches train.stochastic_rounding's value check dropped (a typo silently ran as neither on nor auto)."""
    assert "train.stochastic_rounding: 'yes' is not one of true, false, auto" in refused(
        {"train.stochastic_rounding": "yes"})


def test_a_negative_balance_rate_is_refused():
    """Catches train.balance_rate's lower bound loosened (a negative rate pushes load towards busy experts)."""
    assert "train.balance_rate: must be >= 0, got -0.1" in refused({"train.balance_rate": -0.1})


def test_balancing_is_refused_on_deepseek_v2():
    """Catches aux-loss-free balancing allowed on deepseek_v2, whose router has no bias buffer."""
    assert ("train.balance_rate: aux-loss-free balancing needs a routing-bias buffer that deepseek_v2 does not have"
            in refused({"model.arch": "deepseek_v2", "train.balance_rate": 0.01}))


def test_a_group_of_one_is_refused_and_two_taken():
    """Catches grpo.group_size checked with `< 1` (a group of one has no advantage)."""
    assert "grpo.group_size (1) must be >= 2" in refused({"grpo.group_size": 1})
    assert load_recipe(None, {"grpo.group_size": 2}).grpo.group_size == 2


def test_min_new_tokens_may_equal_max_new_tokens():
    """Catches min_new_tokens == max_new_tokens refused (the documented equal-length benchmark setting)."""
    assert load_recipe(None, {"grpo.min_new_tokens": 8, "grpo.max_new_tokens": 8}).grpo.min_new_tokens == 8


def test_max_generated_tokens_zero_is_refused():
    """Catches grpo.max_generated_tokens checked with `< 0` (a budget of 0 stops before any step)."""
    assert "grpo.max_generated_tokens (0) must be >= 1" in refused({"grpo.max_generated_tokens": 0})


def test_an_unknown_rollout_is_refused():
    """Catches grpo.rollout's value check dropped (a typo ran as neither local nor engine)."""
    assert "grpo.rollout: 'remote' is not one of auto, local, engine" in refused({"grpo.rollout": "remote"})


def test_a_missing_eval_file_is_refused(tmp_path):
    """Catches grpo.eval_path's existence check dropped (the run failed at its first evaluation)."""
    assert f"grpo.eval_path {tmp_path / 'nope.jsonl'}: no such file" in refused(
        {"grpo.eval_path": str(tmp_path / "nope.jsonl")})


# ------------------------------------------------------------------------------------------ grpo.tree

def test_a_tree_segment_of_zero_tokens_is_refused():
    """Catches grpo.tree.segment_len checked with `< 0` (no token to branch at)."""
    assert "grpo.tree.segment_len (0) must be >= 1 (or null: branch anywhere)" in refused(
        {"grpo.tree": {"segment_len": 0}})


def test_segments_that_exactly_fill_the_branchable_tokens_are_taken():
    """Catches the segments' fit checked with >= (2 x 2 fills the 4 branchable tokens of max_new_tokens 5)."""
    r = load_recipe(None, {"grpo.tree": {"enabled": True, "iterations": 2, "segment_len": 2},
                           "grpo.max_new_tokens": 5})
    assert r.grpo.tree.iterations * r.grpo.tree.segment_len == 4


def test_one_new_token_is_fine_without_trees():
    """Catches the tree's max_new_tokens >= 2 check applied with grpo.tree disabled (chain rollouts of 1 token)."""
    assert load_recipe(None, {"grpo.max_new_tokens": 1}).grpo.max_new_tokens == 1


# ------------------------------------------------------------------------------------------ grpo.curriculum, data

def test_a_band_of_three_numbers_or_a_boolean_end_is_refused():
    """Catches band's length check loosened (three numbers taken) or a boolean taken as a pass rate."""
    assert "grpo.curriculum.band: expected [low, high], two pass rates, got [0.1, 0.5, 0.9]" in refused(
        {"grpo.curriculum": {"band": [0.1, 0.5, 0.9]}})
    assert "grpo.curriculum.band: expected [low, high], two pass rates, got [True, 0.5]" in refused(
        {"grpo.curriculum": {"band": [True, 0.5]}})


def test_an_unseen_share_of_one_is_taken():
    """Catches unseen_share's upper bound made exclusive (1.0: every prompt from the unseen ones while any remain)."""
    assert load_recipe(None, {"grpo.curriculum": {"unseen_share": 1.0}}).grpo.curriculum.unseen_share == 1.0


def test_a_score_column_without_score_mode_is_refused():
    """Catches a score_column set beside mode length accepted (the user meant mode: score)."""
    assert ("data.curriculum.score_column is set but data.curriculum.mode is length; set mode: score" in refused(
        {"data.curriculum": {"mode": "length", "score_column": "difficulty"}}))


# ------------------------------------------------------------------------------------------ paths

def test_home_paths_are_expanded(tmp_path, monkeypatch):
    """Catches ~ left unexpanded in data.path, grpo.eval_path and run_dir (a YAML file is read by no shell)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "eval.jsonl").write_text("")
    r = load_recipe(None, {"data.path": "~/corpus.jsonl", "grpo.eval_path": "~/eval.jsonl", "run_dir": "~/runs/a"})
    assert (r.data.path, r.grpo.eval_path, r.run_dir) == (
        str(tmp_path / "corpus.jsonl"), str(tmp_path / "eval.jsonl"), str(tmp_path / "runs" / "a"))


def test_a_home_init_from_is_expanded(tmp_path, monkeypatch):
    """Catches model.init_from left out of the path expansion (transformers takes "~/model" for a hub name)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert (f"model.init_from {tmp_path / 'model'}: not a Hugging Face model directory (no config.json)"
            in refused({"model.init_from": "~/model"}))


def test_bundled_paths_resolve_from_another_directory(tmp_path, monkeypatch):
    """Catches data.tokenizer left out of the engine/ lookup (the shipped recipes' tokenizer not found elsewhere)."""
    monkeypatch.chdir(tmp_path)
    r = load_recipe(None, {"data.path": "engine/assets/corpus.jsonl", "data.tokenizer": "engine/assets/tokenizer"})
    assert (r.data.path, r.data.tokenizer) == (str(ASSETS / "corpus.jsonl"), str(ASSETS / "tokenizer"))


def test_an_engine_path_in_the_working_directory_wins_and_a_missing_one_is_kept(tmp_path, monkeypatch):
    """Catches engine/ paths always replaced by the installed engine's file, also where the working directory holds
    its own or where neither exists (the refusal then named a path the user never wrote)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "engine" / "assets").mkdir(parents=True)
    (tmp_path / "engine" / "assets" / "corpus.jsonl").write_text('{"text": "mine"}\n')
    assert load_recipe(None, {"data.path": "engine/assets/corpus.jsonl"}).data.path == "engine/assets/corpus.jsonl"
    assert load_recipe(None, {"data.path": "engine/assets/gone.jsonl"}).data.path == "engine/assets/gone.jsonl"


def test_a_model_directory_with_either_tokenizer_file_has_a_tokenizer(tmp_path):
    """Catches hf_tokenizer wanting both tokenizer.json and tokenizer_config.json (a model's own tokenizer missed)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_text("{}")
        assert hf_tokenizer(str(d)) == str(d)
    assert hf_tokenizer(str(tmp_path)) is None and hf_tokenizer(None) is None


# ------------------------------------------------------------------------------------------ model.init_from

def test_init_from_sets_the_tokenizer_only_where_it_is_auto(tmp_path):
    """Catches a data.tokenizer written in the recipe replaced by the one saved with model.init_from."""
    d = hf_dir(tmp_path / "hf")
    (d / "tokenizer.json").write_text("{}")
    assert load_recipe(None, {"model.init_from": str(d)}).data.tokenizer == str(d)
    assert load_recipe(None, {"model.init_from": str(d), "data.tokenizer": "/my/tok"}).data.tokenizer == "/my/tok"


def test_a_deepseek_model_without_shared_experts_loads_with_none(tmp_path):
    """Catches an n_shared_experts of 0 read as 1, or the zero-shared-experts refusal applied to a loaded model."""
    d = hf_dir(tmp_path / "hf", n_shared_experts=0)
    assert load_recipe(None, {"model.init_from": str(d)}).model.num_shared_experts == 0


def test_a_null_q_lora_rank_replaces_the_recipes(tmp_path):
    """Catches a q_lora_rank of null in config.json (DeepSeek-V2-Lite) leaving the recipe's rank in place."""
    d = hf_dir(tmp_path / "hf", arch="deepseek_v2")
    m = load_recipe(None, {"model.init_from": str(d), "model.q_lora_rank": 16, "train.balance_rate": 0.0}).model
    assert (m.arch, m.q_lora_rank) == ("deepseek_v2", None)


def test_an_mla_model_with_fewer_kv_heads_is_refused(tmp_path):
    """Catches a deepseek config.json with num_key_value_heads != num_attention_heads let through to transformers."""
    d = hf_dir(tmp_path / "hf", num_key_value_heads=2)
    line = refused({"model.init_from": str(d)})
    assert "config.json has num_key_value_heads 2 but num_attention_heads 4" in line
    assert "set num_key_value_heads to 4 (the weights do not change)" in line


def test_a_loaded_qwen3_moe_ignores_the_recipes_shared_experts(tmp_path):
    """Catches the qwen3_moe/mixtral shared-expert refusal applied with init_from (its config.json decides)."""
    d = hf_dir(tmp_path / "hf", arch="qwen3_moe")
    m = load_recipe(None, {"model.arch": "qwen3_moe", "model.num_shared_experts": 2, "model.init_from": str(d),
                           "train.balance_rate": 0.0}).model
    assert (m.arch, m.num_shared_experts) == ("qwen3_moe", 0)


def test_the_vision_language_qwen3_5_moe_is_told_apart(tmp_path):
    """Catches model_type qwen3_5_moe (the VL model) reported as an unsupported family without the fix."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    line = refused({"model.init_from": str(tmp_path)})
    assert "model_type qwen3_5_moe is the Qwen3.5-MoE vision-language model" in line
    assert "save the language model on its own" in line


def test_a_bad_config_json_is_the_only_line_for_init_from(tmp_path):
    """Catches the weights check added after a config.json problem (two lines where the first is the story)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    line = refused({"model.init_from": str(tmp_path)})
    assert "model_type 'llama' is not a supported family" in line and "no weights" not in line


# ------------------------------------------------------------------------------------------ weights

def index(d: Path, shards: list[str]) -> None:
    weight_map = {f"w{i}": s for i, s in enumerate(shards)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_missing_shards_are_named_three_at_most(tmp_path):
    """Catches missing shards not reported, or ', ...' shown when exactly three are missing."""
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index(tmp_path, names[:3])
    assert weights_problem(tmp_path) == (f"model.safetensors.index.json names 3 shard file(s) that are not there "
                                         f"({', '.join(names[:3])}): copy them in, or save the model again")
    index(tmp_path, names)
    assert f"names 4 shard file(s) that are not there ({', '.join(names[:3])}, ...)" in weights_problem(tmp_path)


def test_an_index_without_a_weight_map_is_one_line(tmp_path):
    """Catches an index missing its weight_map raising KeyError instead of a refusal line."""
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert weights_problem(tmp_path) == ("model.safetensors.index.json is not a weights index (a JSON object with a "
                                         "weight_map: KeyError 'weight_map')")


def test_an_index_naming_a_shard_that_is_not_a_string_is_one_line(tmp_path):
    """An index whose weight_map holds null (or a number) is refused in one line, not a TypeError from the path join.
    [fails if: the shard names are joined to the directory unchecked]"""
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"a": null}}')
    assert weights_problem(tmp_path) == ("model.safetensors.index.json is not a weights index (a JSON object with a "
                                         "weight_map: TypeError a shard name that is not a string)")


def test_a_cut_shard_is_named_and_a_bin_file_is_not_read_as_safetensors(tmp_path):
    """Catches sharded safetensors never checked for a cut, or pytorch_model.bin read as a safetensors file."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a safetensors header")
    assert weights_problem(a) is None
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index(b, names)
    safetensors(b / names[0])
    size = safetensors(b / names[1])
    (b / names[1]).write_bytes((b / names[1]).read_bytes()[:-4])
    assert weights_problem(b) == (f"{names[1]} is cut short: {size - 4:,} of the {size:,} bytes its header describes: "
                                  "copy it again, or save the model again")


def test_a_file_one_byte_short_is_cut(tmp_path):
    """Catches the 8 length bytes left out of the size a header describes (a file cut by up to 8 bytes passed)."""
    size = safetensors(tmp_path / "m.safetensors", tensors=2, metadata=False)
    assert safetensors_problem(tmp_path / "m.safetensors") is None
    (tmp_path / "m.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes()[:-1])
    assert safetensors_problem(tmp_path / "m.safetensors") == (
        f"is cut short: {size - 1:,} of the {size:,} bytes its header describes")
