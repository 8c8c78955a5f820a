"""The hostfile, .deepspeed_env and check_cluster inputs (engine/cluster.py) and the recipe's field checks
(engine/config.py), rule by rule, without a launcher or SSH; the bracket at the end of a docstring says which bent
rule the test fails on."""
from __future__ import annotations

import re

import pytest

from engine import cluster
from engine.cluster import Host, InputError, judge, master_address, parse_args, parse_hostfile, read_deepspeed_env, \
    read_inputs, remote_exports
from engine.config import ConfigError, load_recipe

A, B = "10.124.0.2", "10.124.0.3"


def hostfile(tmp_path, text: str):
    f = tmp_path / "hosts"
    f.write_text(text)
    return f


def refused(tmp_path, text: str) -> str:
    with pytest.raises(InputError) as e:
        parse_hostfile(hostfile(tmp_path, text))
    assert "\n" not in str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------------------------- cluster: hostfile


def test_indented_host_and_comment_lines_are_read_as_deepspeed_reads_them(tmp_path):
    """DeepSpeed's runner strips each hostfile line before reading it, so an indented comment is a comment and an
    indented host line is a host; the check accepts both the same way.
    [fails if: only trailing whitespace is stripped from hostfile lines]"""
    hosts = parse_hostfile(hostfile(tmp_path, "  # node list\n\t" + A + " slots=2\n   \n  " + B + " slots=2\n"))
    assert [(h.name, h.slots, h.line) for h in hosts] == [(A, 2, 2), (B, 2, 4)]


def test_a_comment_after_the_slots_is_allowed(tmp_path):
    """A '#' after 'slots=N' starts a comment (hostfiles/template: "'#' starts a comment"; DeepSpeed's runner reads
    such a line too), so 'HOST slots=N  # note' is a host line, not a malformed one.
    [fails if: the hostfile pattern no longer allows a trailing # comment]"""
    hosts = parse_hostfile(hostfile(tmp_path, f"{A} slots=8   # node 0\n{B} slots=8 #node 1\n"))
    assert [(h.name, h.slots) for h in hosts] == [(A, 8), (B, 8)]


def test_zero_slots_are_refused(tmp_path):
    """slots=0 (a node that would start no rank) is refused in one line naming the line and the rule.
    [fails if: the slots check is `< 0` instead of `< 1`, accepting slots=0]"""
    msg = refused(tmp_path, f"{A} slots=0\n{B} slots=1\n")
    assert "line 1: 10.124.0.2 slots=0: slots must be a whole number >= 1" in msg


def test_slots_with_trailing_junk_are_one_line_not_a_traceback(tmp_path):
    """slots must be all digits: 'slots=8x' or 'slots=8,' is an InputError naming the line, never the ValueError
    that int() would raise.
    [fails if: the digits check matches only a prefix of the slot count (re.match instead of re.fullmatch)]"""
    msg = refused(tmp_path, f"{A} slots=8x\n{B} slots=8,\n")
    assert "line 1: 10.124.0.2 slots=8x: slots must be a whole number >= 1" in msg
    assert "line 2: 10.124.0.3 slots=8,: slots must be a whole number >= 1" in msg


def test_a_host_listed_twice_is_refused(tmp_path):
    """The same host on two lines is refused (DeepSpeed would refuse it later, after contacting nodes).
    [fails if: the duplicate-host check is dropped]"""
    msg = refused(tmp_path, f"{A} slots=1\n{B} slots=1\n{A} slots=1\n")
    assert "line 3: host 10.124.0.2 is listed twice" in msg


def test_a_duplicate_names_the_line_of_the_first_entry(tmp_path):
    """The duplicate-host line says on which hostfile line the host first appeared (comments counted), so the user
    can merge the two lines.
    [fails if: the first line of a host is recorded as its position among hosts instead of its line number]"""
    msg = refused(tmp_path, f"# two nodes\n{A} slots=1\n{B} slots=1\n{A} slots=2\n")
    assert "line 4: host 10.124.0.2 is listed twice (first on line 2)" in msg


def test_every_hostfile_problem_is_named_at_once(tmp_path):
    """All problems of a hostfile come in the one line, not just the first one found.
    [fails if: only the first hostfile problem is raised]"""
    msg = refused(tmp_path, f"{A} slots=0\n{B} slot=1\n")
    assert "line 1: 10.124.0.2 slots=0" in msg and "line 2: '10.124.0.3 slot=1' is not 'HOST slots=N'" in msg


@pytest.mark.parametrize("local", ["127.0.0.1", "::1", "localhost"])
def test_a_loopback_address_in_a_multi_node_hostfile_is_refused(tmp_path, local):
    """127.0.0.1, ::1 and localhost name a different machine on every node: beside other nodes they are refused.
    [fails if: 127.0.0.1 is left out of the local names]"""
    msg = refused(tmp_path, f"{A} slots=1\n{local} slots=1\n")
    assert f"line 2: {local} in a multi-node hostfile" in msg


# ---------------------------------------------------------------------------------------------- cluster: environment


def test_a_deepspeed_env_value_may_hold_an_equals_sign(tmp_path):
    """A .deepspeed_env line is split at its first '=' as DeepSpeed's runner does: the value keeps later '='s.
    [fails if: .deepspeed_env lines are split at the last '=']"""
    f = tmp_path / ".deepspeed_env"
    f.write_text("NCCL_DEBUG_SUBSYS=INIT,ENV\nPYTHONWARNINGS=ignore::a=b\n")
    assert read_deepspeed_env(f) == {"NCCL_DEBUG_SUBSYS": "INIT,ENV", "PYTHONWARNINGS": "ignore::a=b"}


@pytest.mark.parametrize("line", ["# NCCL_SOCKET_IFNAME=eth1", "export NCCL_IB_DISABLE=1", "NCCL-X=1"])
def test_a_deepspeed_env_line_whose_key_is_not_a_name_is_refused(tmp_path, line):
    """A line with an '=' whose left side is not a variable name (a comment holding '=', an `export` line) is
    refused: the runner would send `export # ...;` and comment out the rest of the remote command.
    [fails if: the variable-name check on .deepspeed_env keys is dropped, keeping only the '=' check]"""
    f = tmp_path / ".deepspeed_env"
    f.write_text(f"NCCL_IB_DISABLE=1\n{line}\n")
    with pytest.raises(InputError, match=r"line 2: .* is not KEY=VALUE"):
        read_deepspeed_env(f)


def test_the_launch_directorys_deepspeed_env_wins_over_the_home_one(tmp_path, monkeypatch):
    """The runner reads ~/.deepspeed_env, then ./.deepspeed_env: a key in both takes the launch directory's value,
    a key only at home keeps home's.
    [fails if: the two .deepspeed_env files are read in the other order]"""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / cluster.DS_ENV_NAME).write_text("NCCL_TEST_A=home\nNCCL_TEST_B=home\n")
    (work / cluster.DS_ENV_NAME).write_text("NCCL_TEST_A=work\n")
    env = remote_exports(work)
    assert (env["NCCL_TEST_A"], env["NCCL_TEST_B"]) == ("work", "home")


def test_remote_pythonpath_starts_with_the_launch_directory(tmp_path, monkeypatch):
    """The PYTHONPATH sent to every node puts the launch directory first, then the launching shell's PYTHONPATH.
    [fails if: the launch directory is appended after the existing PYTHONPATH]"""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.deepspeed_env
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    assert remote_exports(tmp_path)["PYTHONPATH"] == f"{tmp_path}:/opt/site"


# ---------------------------------------------------------------------------------------------- cluster: arguments


@pytest.mark.parametrize("name", ["size_mb", "iters", "timeout", "connect_timeout"])
def test_a_zero_count_argument_is_refused(tmp_path, monkeypatch, name):
    """--size_mb, --iters, --timeout and --connect_timeout must be > 0: 0 is bad input (exit 2), not a run.
    [fails if: these arguments are checked with `< 0` instead of `<= 0`]"""
    monkeypatch.chdir(tmp_path)
    hostfile(tmp_path, f"{A} slots=1\n")
    with pytest.raises(InputError, match=f"--{name} must be a finite number > 0, got 0"):
        read_inputs(parse_args(["--hostfile", "hosts", f"--{name}", "0"]))


def test_master_port_65536_is_refused_and_65535_taken(tmp_path, monkeypatch):
    """Ports run 1..65535: 65536 is refused in one line, 65535 is accepted.
    [fails if: the port bound is `<= 65536`]"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    hostfile(tmp_path, f"{A} slots=1\n")
    with pytest.raises(InputError, match="--master_port 65536 is not a port number"):
        read_inputs(parse_args(["--hostfile", "hosts", "--master_port", "65536"]))
    hosts, _ = read_inputs(parse_args(["--hostfile", "hosts", "--master_port", "65535"]))
    assert [h.name for h in hosts] == [A]


def test_the_default_master_is_the_first_host():
    """Without --master_addr, rank 0's address is the hostfile's first host (node 0), or 127.0.0.1 for one host.
    [fails if: the default master address is taken from the last host]"""
    args = parse_args(["--hostfile", "h", "--master_port", "29500"])
    assert master_address(args, [Host(A, 8, 1), Host(B, 8, 2)]) == (A, 29500)
    assert master_address(args, [Host(A, 8, 1)]) == ("127.0.0.1", 29500)


def test_a_different_engine_source_on_a_node_fails_the_check():
    """Hosts whose engine (version + source hash) differs fail, like a differing torch or deepspeed.
    [fails if: the engine is left out of the software compared between hosts]"""
    probe = {"python": "3.11", "torch": "2", "deepspeed": "0.16", "transformers": "4", "gpus": 0}
    r = judge([Host(A, 1, 1), Host(B, 1, 2)], [{**probe, "engine": "checkout (aaaa1111)"},
                                              {**probe, "engine": "checkout (bbbb2222)"}], A, 29500)
    assert any(f.startswith(f"host {B}: engine checkout (bbbb2222) differs from {A}'s") for f in r.failures), r.failures


# ---------------------------------------------------------------------------------------------- config: types


def recipe_error(overrides: dict) -> str:
    with pytest.raises(ConfigError) as e:
        load_recipe(None, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_boolean_is_not_taken_as_an_integer():
    """YAML true/false in an int field is refused (bool is an int subclass in Python: true would train 1 step).
    [fails if: bool values pass the int type check]"""
    msg = recipe_error({"train.max_steps": True, "model.num_layers": False})
    assert "train.max_steps: expected int, got True" in msg and "model.num_layers: expected int, got False" in msg


def test_an_exponent_without_a_dot_is_read_as_a_float(tmp_path):
    """YAML 1.1 reads `lr: 1e-4` (no dot) as the string '1e-4': the recipe still takes it as the number 0.0001.
    [fails if: numeric strings are no longer converted for float fields]"""
    (tmp_path / "r.yaml").write_text("train:\n  lr: 1e-4\n  min_lr_ratio: 5e-1\n")
    r = load_recipe(tmp_path / "r.yaml")
    assert (r.train.lr, r.train.min_lr_ratio) == (1e-4, 0.5) and isinstance(r.train.lr, float)


@pytest.mark.parametrize("value", [".nan", "nan", ".inf"])
def test_a_non_finite_learning_rate_is_refused(tmp_path, value):
    """NaN passes every < and > check, so a non-finite float is refused by name (YAML .nan/.inf, or 'nan').
    [fails if: the finite-number check is dropped]"""
    (tmp_path / "r.yaml").write_text(f"train:\n  lr: {value}\n")
    with pytest.raises(ConfigError, match=r"train.lr: must be a finite number, got (nan|inf)"):
        load_recipe(tmp_path / "r.yaml")


def test_a_boolean_in_a_plain_string_field_is_refused_not_renamed():
    """Only fields whose default is 'off' (grpo.routing_replay) read YAML's bare off/on as that word; a boolean in
    another string field (data.text_field: yes, model.arch: true) is a type error, not the string 'on'.
    [fails if: the YAML off/on coercion applies to every string field]"""
    msg = recipe_error({"data.text_field": True, "model.arch": True})
    assert "data.text_field: expected str, got True" in msg and "model.arch: expected str, got True" in msg


# ---------------------------------------------------------------------------------------------- config: ranges


def test_every_expert_per_token_is_allowed():
    """experts_per_token may equal num_experts (each token to every expert); only more than that is refused.
    [fails if: experts_per_token must be strictly below num_experts]"""
    assert load_recipe(None, {"model.experts_per_token": 8, "model.num_experts": 8}).model.experts_per_token == 8
    assert "model.experts_per_token (9) must be <= model.num_experts (8)" in recipe_error(
        {"model.experts_per_token": 9, "model.num_experts": 8})


def test_first_dense_layers_must_leave_an_moe_layer():
    """first_dense_layers lies in [0, num_layers): as many dense layers as layers (no MoE layer left) is refused.
    [fails if: first_dense_layers == num_layers is accepted]"""
    assert "model.first_dense_layers (2) must be in [0, num_layers)" in recipe_error(
        {"model.first_dense_layers": 2, "model.num_layers": 2})
    assert load_recipe(None, {"model.first_dense_layers": 1, "model.num_layers": 2}).model.first_dense_layers == 1


def test_a_sequence_of_one_token_is_refused():
    """data.seq_len needs at least 2 tokens (one input predicting one next token).
    [fails if: the lower bound of data.seq_len is 1]"""
    assert "data.seq_len (1) must be in [2, model.max_position_embeddings=512]" in recipe_error({"data.seq_len": 1})
    assert load_recipe(None, {"data.seq_len": 2}).data.seq_len == 2


def test_min_lr_ratio_of_one_is_a_constant_lr():
    """min_lr_ratio is in [0, 1] inclusive: 1.0 (no decay) is accepted, above 1 refused.
    [fails if: min_lr_ratio 1.0 is refused (upper bound exclusive)]"""
    assert load_recipe(None, {"train.min_lr_ratio": 1.0}).train.min_lr_ratio == 1.0
    assert "train.min_lr_ratio (1.5) must be in [0, 1]" in recipe_error({"train.min_lr_ratio": 1.5})


def test_decay_steps_zero_is_refused():
    """train.decay_steps, when set, must be >= 1 (null means max_steps).
    [fails if: decay_steps 0 is accepted]"""
    assert "train.decay_steps: must be >= 1 (or null: train.max_steps), got 0" in recipe_error({"train.decay_steps": 0})


def test_keep_last_zero_is_refused():
    """checkpoint.keep_last 0 would prune every checkpoint: refused.
    [fails if: keep_last 0 is accepted]"""
    assert "checkpoint: every_steps and every_minutes must be >= 0 and keep_last >= 1" in recipe_error(
        {"checkpoint.keep_last": 0})


def test_a_band_of_one_point_is_allowed():
    """grpo.curriculum.band needs low <= high: [0.5, 0.5] (only prompts at exactly 0.5 at full weight) is valid.
    [fails if: a band with low == high is refused as inverted]"""
    r = load_recipe(None, {"grpo.curriculum": {"enabled": True, "band": [0.5, 0.5]}})
    assert r.grpo.curriculum.band == [0.5, 0.5]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_one_shared_expert_reads_as_none_for_families_without_them(arch):
    """qwen3_moe and mixtral have no shared experts; num_shared_experts 1 (the default, also written in tiny.yaml)
    means none and loads; 2 or more is refused.
    [fails if: num_shared_experts >= 1 (not > 1) is refused for those families]"""
    r = load_recipe(None, {"model.arch": arch, "train.balance_rate": 0.0})
    assert r.model.num_shared_experts == 1
    assert f"model.num_shared_experts: {arch} has no shared experts" in recipe_error(
        {"model.arch": arch, "model.num_shared_experts": 2, "train.balance_rate": 0.0})


def test_data_seed_zero_is_a_seed():
    """data.seed 0 orders the data by seed 0; only null falls back to train.seed.
    [fails if: data.seed is read with `or`, so 0 falls back to train.seed]"""
    assert load_recipe(None, {"train.seed": 5, "data.seed": 0}).data_seed() == 0
    assert load_recipe(None, {"train.seed": 5}).data_seed() == 5


def test_a_recipe_that_is_not_a_mapping_is_one_line_with_or_without_overrides(tmp_path):
    """A recipe YAML holding a list is named in one line, also when --set/--max_steps overrides are applied (they
    raised AttributeError). [fails if: overrides applied before the mapping check]"""
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    for overrides in (None, {"train.max_steps": 5}):
        with pytest.raises(ConfigError, match=r"expected a mapping of sections \(model:, train:, data:, ...\), got list"):
            load_recipe(p, overrides)


def test_an_override_reaches_an_empty_section_and_a_nested_one(tmp_path):
    """`train:` with nothing under it reads as None: an override of train.max_steps still applies; a nested key
    (grpo.tree.enabled) reaches its subsection. [fails if: overrides dropped on a None section, or split at the last
    dot only]"""
    p = tmp_path / "empty.yaml"
    p.write_text("train:\n")
    assert load_recipe(p, {"train.max_steps": 5}).train.max_steps == 5
    r = load_recipe(None, {"grpo.tree.enabled": True, "grpo.curriculum.band": [0.3, 0.6]})
    assert r.grpo.tree.enabled is True and list(r.grpo.curriculum.band) == [0.3, 0.6]


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_check_cluster_refuses_a_size_that_is_not_a_finite_number(tmp_path, value):
    """--size_mb nan / inf is refused before any probe (nan <= 0 is False). [fails if: only `<= 0` checked]"""
    f = hostfile(tmp_path, f"{A} slots=8\n{B} slots=8\n")
    with pytest.raises(InputError, match="--size_mb must be a finite number > 0"):
        read_inputs(parse_args(["--hostfile", str(f), "--size_mb", value]))
