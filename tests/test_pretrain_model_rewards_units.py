"""Unit checks of engine/rewards.py's parsers and spec checks, engine/model.py's
recipe -> transformers config mapping, and engine/pretrain.py's preflight edges and small helpers (fakes in place
of torch.distributed and the DeepSpeed engine). Each pins a behaviour a small change to the code would break."""
import resource
import socket
from fractions import Fraction
from types import SimpleNamespace as NS

import pytest
import torch

from conftest import ROOT, ZERO3, save_tiny_hf, write_ds

from engine.config import RECIPES, ConfigError, ModelConfig
from engine.rewards import build_rewards, numeric

TINY = (RECIPES / "tiny.yaml").read_text()


# ---------------------------------------------------------------- rewards


def test_numeric_reads_thousands_separators_and_fraction_answers():
    """A number written with thousands separators is one number (1,234,567.5), commas that do not group by three
    split numbers ("12,34" is 12 then 34), a tolerance of 0 accepts an exact match, and a fractions.Fraction answer
    is taken as its value, not as the text "1/2". [fails if: the comma grouping is dropped from the number pattern,
    or a numbers.Real answer goes through str() and its last number]"""
    assert numeric("p", "paid 1,234,567.5 in total", 1234567.5) == 1.0
    assert numeric("p", "paid 1,234,567.5 in total", 567.5) == 0.0
    assert numeric("p", "12,34", 34, which="last") == 1.0 and numeric("p", "12,34", 12, which="first") == 1.0
    assert numeric("p", "5", 5, tolerance=0) == 1.0
    assert numeric("p", "x = 0.5", Fraction(1, 2)) == 1.0


def test_reward_spec_values_are_checked_at_build_time():
    """Built-in parameters with wrong values are refused in the one ConfigError: numeric's `which` must be first or
    last, regex's pattern must be a string, length_penalty's target a non-negative int; a weight that is a bool or
    not finite and an empty label are refused too. A target of 0 is valid. [fails if: the `which` check, the
    pattern's string check, the target check (or its `< 0` made `<= 0`), bool exclusion, the finite-weight check or
    the empty-label check is dropped]"""
    specs = [{"name": "numeric", "which": "middle"},
             {"name": "regex", "pattern": 5},
             {"name": "length_penalty", "target": -1},
             {"name": "length_penalty", "target": "10", "label": "lp2"},
             {"name": "exact_match", "weight": True},
             {"name": "exact_match", "weight": float("inf"), "label": "em2"},
             {"name": "exact_match", "label": ""}]
    with pytest.raises(ConfigError) as e:
        build_rewards(specs)
    msg = str(e.value)
    for expected in ("rewards[0].which: must be 'first' or 'last', got 'middle'",
                     "rewards[1].pattern: must be a string, got 5",
                     "rewards[2].target: must be an integer >= 0 (characters), got -1",
                     "rewards[3].target: must be an integer >= 0 (characters), got '10'",
                     "rewards[4].weight: must be a finite number, got True",
                     "rewards[5].weight: must be a finite number, got inf",
                     "rewards[6].label: must be a non-empty string, got ''"):
        assert expected in msg, (expected, msg)
    rs = build_rewards([{"name": "length_penalty", "target": 0, "scale": 0.5},
                        {"name": "numeric", "which": "first", "tolerance": 0}])
    assert rs.score(["p"], ["abcd"], [4]).total.tolist() == [-2.0 + 0.0]  # 4 chars over 0 x 0.5; "abcd" no number


def test_user_module_problems_name_the_module_and_the_function(tmp_path, monkeypatch):
    """A user module that raises any error while importing is reported as "cannot import" with the error, and a
    module attribute that is not callable (math.pi) as "has no function". [fails if: only ImportError is caught
    (the RuntimeError escapes), or `callable` is weakened to `is not None`]"""
    (tmp_path / "boom_rewards.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        build_rewards([{"name": "boom_rewards:f"}, {"name": "math:pi"}])
    msg = str(e.value)
    assert "rewards[0].name: cannot import module 'boom_rewards' (RuntimeError: no GPU here)" in msg, msg
    assert "rewards[1].name: module 'math' has no function 'pi'" in msg, msg


def test_a_reward_returning_a_tensor_or_decimal_scores_its_value(tmp_path, monkeypatch):
    """A reward may return anything float() takes (a 0-dim tensor, a Decimal): scored as that value, not counted as a
    failure. [fails if: only numbers.Real results are accepted]"""
    (tmp_path / "typed_rewards.py").write_text(
        "import torch\nfrom decimal import Decimal\n"
        "def as_tensor(prompt, completion, answer):\n    return torch.tensor(0.5)\n"
        "def as_decimal(prompt, completion, answer):\n    return Decimal('0.25')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = build_rewards([{"name": "typed_rewards:as_tensor", "label": "t"},
                       {"name": "typed_rewards:as_decimal", "label": "d", "weight": 2.0}]).score(["p"], ["c"], [None])
    assert s.failures == {"t": 0, "d": 0} and s.first_error == {}
    assert s.per_reward["t"].tolist() == [0.5] and s.per_reward["d"].tolist() == [0.25]
    assert s.total.tolist() == [1.0]  # 0.5 + 2 x 0.25


def test_score_refuses_fewer_answers_than_completions():
    """score() raises on any length mismatch, answers included, instead of zip silently scoring fewer samples.
    [fails if: the answers' length is not compared]"""
    rs = build_rewards([{"name": "exact_match"}])
    with pytest.raises(ValueError, match="3 prompts, 3 completions and 2 answers"):
        rs.score(["a", "b", "c"], ["a", "b", "c"], ["a", "b"])


# ---------------------------------------------------------------- model


def distinct(arch: str) -> ModelConfig:
    """A model section whose every size differs from the others and from its default."""
    return ModelConfig(arch=arch, hidden_size=96, num_layers=5, num_heads=6, num_kv_heads=2, intermediate_size=200,
                       moe_intermediate_size=40, num_experts=6, experts_per_token=3, num_shared_experts=2,
                       first_dense_layers=1, vocab_size=300, max_position_embeddings=777, kv_lora_rank=24,
                       q_lora_rank=48, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=20, rope_theta=12345.0)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "qwen3_5_moe"])
def test_every_recipe_field_reaches_the_transformers_config(arch):
    """make_hf_config maps each model field onto the family's own config key, checked against values written out
    here: common sizes, rope theta, the tokenizer's special ids (pad 0, bos 1, eos 2), untied embeddings; MLA's
    one key/value head per query head and its head dims; the routing settings; the experts' and shared experts'
    widths; Qwen3.5's linear-attention heads and its full-attention layer every fourth. [fails if: any field is
    dropped, swapped with another or taken from the wrong recipe field]"""
    from engine.data import load_tokenizer
    from engine.model import make_hf_config

    tok = load_tokenizer(str(ROOT / "engine" / "assets" / "tokenizer"))
    c = make_hf_config(distinct(arch), tok)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (300, 96, 5, 6)
    assert (c.max_position_embeddings, c.num_experts_per_tok, c.tie_word_embeddings) == (777, 3, False)
    assert c.rope_parameters["rope_theta"] == 12345.0
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (0, 1, 2)
    if arch.startswith("deepseek"):
        assert c.model_type == arch and c.num_key_value_heads == 6  # MLA: as many as the query heads, not 2
        assert (c.n_routed_experts, c.n_shared_experts, c.first_k_dense_replace) == (6, 2, 1)
        assert (c.kv_lora_rank, c.q_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (24, 48, 4, 12,
                                                                                                          20)
        assert (c.moe_intermediate_size, c.intermediate_size, c.routed_scaling_factor) == (40, 200, 1.0)
        if arch == "deepseek_v3":
            assert (c.topk_method, c.scoring_func, c.norm_topk_prob, c.head_dim) == ("noaux_tc", "sigmoid", True, 4)
            assert (c.n_group, c.topk_group) == (1, 1)
        else:
            assert c.topk_method == "greedy"
    elif arch == "qwen3_moe":
        assert (c.num_experts, c.num_key_value_heads, c.head_dim, c.norm_topk_prob) == (6, 2, 16, True)
        assert (c.moe_intermediate_size, c.intermediate_size, c.decoder_sparse_step, c.mlp_only_layers) == (40, 200, 1,
                                                                                                            [])
    elif arch == "mixtral":
        assert (c.num_local_experts, c.num_key_value_heads, c.head_dim) == (6, 2, 16)
        assert c.intermediate_size == 40  # the experts' width (moe_intermediate_size), not the dense 200
    else:
        assert c.model_type == "qwen3_5_moe_text"
        assert (c.num_experts, c.num_key_value_heads, c.head_dim, c.moe_intermediate_size) == (6, 2, 16, 40)
        assert c.shared_expert_intermediate_size == 80  # 2 shared experts x 40
        assert (c.linear_num_value_heads, c.linear_num_key_heads, c.linear_key_head_dim,
                c.linear_value_head_dim) == (6, 2, 16, 16)
        assert c.layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    if arch in ("qwen3_moe", "mixtral", "qwen3_5_moe"):
        assert c.output_router_logits is False


def test_a_new_model_is_built_without_a_kv_cache_in_training_mode():
    """build_model (ZeRO stage 0: no zero.Init) returns the recipe's model with use_cache off (training never
    decodes, and the cache would hold every layer's keys and values) and in training mode. [fails if: use_cache
    is left on]"""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from engine.model import build_model

    m = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32,
                    moe_intermediate_size=16, num_experts=4)
    try:
        model = build_model(m, {"zero_optimization": {"stage": 0}})
    finally:
        unset_hf_deepspeed_config()
    assert model.config.use_cache is False and model.training
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.n_routed_experts) == (1, 32, 4)


def test_the_compiled_rms_norm_is_transformers_arithmetic_with_a_trained_weight():
    """_rms_norm (the function compile_parameter_free compiles) equals transformers' RMSNorm to the bit in bf16 with
    a weight that is not all ones (a trained model's): the weight multiplies the normalized value after it is cast
    to bf16. [fails if: the product is taken in fp32 and cast afterwards, which a fresh model's unit weight hides]"""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from engine.model import _rms_norm

    g = torch.Generator().manual_seed(0)
    norm = DeepseekV3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) * 3 + 0.1)
    x = torch.randn(4, 7, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(_rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_build_model_takes_the_tokenizer_dtype_device_and_attention_and_keeps_the_deepspeed_config():
    """build_model builds the recipe's model with the tokenizer's special ids, in the dtype asked, on the device
    asked (meta here), with the recipe's attention implementation, the chunked output layer installed
    (engine/head.py), and the DeepSpeed config still seen by transformers after the call (it holds only a weak
    reference). [fails if: any of tokenizer, dtype, device or attn_implementation is not passed on, head.install is
    skipped, or the HfDeepSpeedConfig is not kept alive on the model]"""
    import gc

    from transformers.integrations.deepspeed import deepspeed_config, unset_hf_deepspeed_config

    from engine.data import load_tokenizer
    from engine.model import build_model

    tok = load_tokenizer(str(ROOT / "engine" / "assets" / "tokenizer"))
    m = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32,
                    moe_intermediate_size=16, num_experts=4, attn_implementation="eager")
    try:
        model = build_model(m, {"zero_optimization": {"stage": 0}}, tok, dtype=torch.bfloat16, device="meta")
        gc.collect()
        assert deepspeed_config() == {"zero_optimization": {"stage": 0}}
    finally:
        unset_hf_deepspeed_config()
    c = model.config
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id, c._attn_implementation) == (0, 1, 2, "eager")
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.bfloat16, "meta")}
    assert model._plain_forward is not None  # head.install's mark: model(ids, labels=...) goes through the chunks


def test_a_loaded_model_takes_the_dtype_and_attention_asked(tmp_path):
    """build_model with model.init_from loads the saved model (fp32 on disk) in the dtype asked and with the recipe's
    attention implementation. [fails if: from_pretrained is not given dtype or attn_implementation]"""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from engine.model import build_model, make_hf_config

    small = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32,
                        moe_intermediate_size=16, num_experts=4, vocab_size=64)
    AutoModelForCausalLM.from_config(make_hf_config(small)).save_pretrained(tmp_path / "hf")
    try:
        model = build_model(ModelConfig(init_from=str(tmp_path / "hf"), attn_implementation="eager"),
                            {"zero_optimization": {"stage": 0}}, dtype=torch.bfloat16)
    finally:
        unset_hf_deepspeed_config()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.config._attn_implementation == "eager"
    assert model.config.hidden_size == 32 and model.config.use_cache is False


def test_build_model_builds_the_hf_config_it_is_given():
    """build_model(hf_config=...) builds that config (GRPO's reference: a twin of the policy), not the recipe's.
    [fails if: the given config is ignored]"""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from engine.model import build_model, make_hf_config

    m = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32,
                    moe_intermediate_size=16, num_experts=4)
    twin = make_hf_config(ModelConfig(num_layers=2, hidden_size=48, num_heads=2, num_kv_heads=2,
                                      intermediate_size=32, moe_intermediate_size=16, num_experts=6))
    try:
        model = build_model(m, {"zero_optimization": {"stage": 0}}, hf_config=twin, device="meta")
    finally:
        unset_hf_deepspeed_config()
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.n_routed_experts) == (2, 48, 6)


def test_make_hf_config_refuses_an_unknown_arch():
    """[fails if: an unknown arch returns None instead of raising]"""
    from engine.model import make_hf_config

    with pytest.raises(ValueError, match="unknown arch llama"):
        make_hf_config(ModelConfig(arch="llama"))


# Modules as compile_parameter_free finds them by class name in a transformers model, in a module of their own whose
# rotary functions it patches (as the attention code calls them as globals of its own module).
class FakeRMSNorm(torch.nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.variance_epsilon = eps


class GatedRMSNorm(torch.nn.Module):  # an RMSNorm of another arithmetic (no variance_epsilon): not compiled
    eps = 1e-6


class FakeMLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(4, 4, bias=False) for _ in range(3))
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            torch.nn.init.normal_(lin.weight, generator=g)
        self.act_fn = act


class GeluMLP(FakeMLP):
    pass


class Float8Linear(torch.nn.Linear):
    linear_mm_config, config = "mm config", "float8 config"


def rotary(q, k):
    return q + k


def fake_hf_model(monkeypatch):
    """A model of the modules above in a module of its own, holding both rotary functions."""
    import types

    from transformers.activations import ACT2FN

    hf = types.ModuleType("fake_modeling")
    hf.apply_rotary_pos_emb = rotary
    hf.apply_rotary_pos_emb_interleave = rotary
    monkeypatch.setitem(__import__("sys").modules, "fake_modeling", hf)
    model = type("FakeForCausalLM", (torch.nn.Module,), {"__module__": "fake_modeling"})()
    model.norm, model.gated = FakeRMSNorm(eps=0.5), GatedRMSNorm()
    model.mlp, model.gelu_mlp = FakeMLP(ACT2FN["silu"]), GeluMLP(ACT2FN["gelu"])
    model.fp8 = Float8Linear(4, 3)
    return model, hf


def spy_compile(monkeypatch):
    """torch.compile replaced by a wrapper that logs each compile (its options) and each call of a compiled
    function, then runs the function as is."""
    log = []

    def compile_(fn, options=None, **kw):
        log.append(("compile", fn.__name__, options))

        def compiled(*args, **kwargs):
            log.append(("call", fn.__name__))
            return fn(*args, **kwargs)
        return compiled

    monkeypatch.setattr(torch, "compile", compile_)
    return log


def test_compile_parameter_free_patches_what_it_knows_with_the_eager_arithmetic(monkeypatch):
    """compile_parameter_free patches each RMSNorm with a variance_epsilon (not another norm), each MLP whose
    activation is SiLU (not GELU), each Float8Linear and both rotary functions of the model's module, every one
    compiled with emulate_precision_casts; the patched forwards compute what the modules did: the norm with the
    module's own eps (0.5), silu(gate) * up, the FP8 matmul given (input, weight, mm config, config) plus the bias.
    A second call leaves the already compiled rotary functions as they are. [fails if: a norm without
    variance_epsilon or a non-SiLU MLP is patched, a kind or a rotary function is missed, precision casts are not
    emulated, the norm's eps, the gate and up projections, the FP8 arguments or the bias are mixed up, or a rotary
    function is wrapped twice]"""
    import torch.nn.functional as F

    import engine.model as model_py

    log = spy_compile(monkeypatch)
    fp8_calls = []

    def fp8_linear(x, weight, mm_config, config):
        fp8_calls.append((mm_config, config))
        return x @ weight.t()

    monkeypatch.setattr(model_py, "_fp8_linear", fp8_linear)
    model, hf = fake_hf_model(monkeypatch)
    done = model_py.compile_parameter_free(model)
    assert done == ["FakeMLP (silu(gate) * up)", "FakeRMSNorm (norm)", "Float8Linear (fp8 casts and GEMM)",
                    "apply_rotary_pos_emb (rotary)", "apply_rotary_pos_emb_interleave (rotary)"]
    assert sorted(e[1] for e in log) == ["_rms_norm", "_silu_mul", "fp8_linear", "rotary", "rotary"]
    assert {e[2]["emulate_precision_casts"] for e in log} == {True}
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    w = model.norm.weight
    assert torch.allclose(model.norm(x), w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.5)))
    mlp = model.mlp
    assert torch.allclose(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    assert torch.allclose(model.fp8(x), x @ model.fp8.weight.t() + model.fp8.bias)
    assert fp8_calls == [("mm config", "float8 config")]
    assert [e for e in log if e[0] == "call"] == [("call", n) for n in ("_rms_norm", "_silu_mul", "fp8_linear")]
    assert "forward" not in vars(model.gated) and "forward" not in vars(model.gelu_mlp)
    assert hf.apply_rotary_pos_emb(1, 2) == 3 and log[-1] == ("call", "rotary")
    patched = hf.apply_rotary_pos_emb
    assert model_py.compile_parameter_free(model) == done[:3] and hf.apply_rotary_pos_emb is patched


@pytest.mark.parametrize("lengths_vary", [False, True])
def test_compiled_functions_run_with_autograd_or_in_grpo_and_never_inside_another_compile(monkeypatch,
                                                                                            lengths_vary):
    """The compiled code runs for calls with autograd on; for no-grad calls only in GRPO (lengths_vary: its
    reference and old log-probs); inside another compile never (the eager code is traced into it). In GRPO every
    dimension of a tensor argument but the last is marked dynamic before the call (a (2, 3, 4) input: dims 0 and 1;
    the 1-D weight: none), in pretraining none. [fails if: the grad, lengths_vary or is_compiling condition is
    dropped, pretraining marks dimensions dynamic, or the last dimension is marked]"""
    import engine.model as model_py

    log = spy_compile(monkeypatch)
    marked = []
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, d: marked.append((tuple(t.shape), d)))
    model, _ = fake_hf_model(monkeypatch)
    model_py.compile_parameter_free(model, lengths_vary=lengths_vary)
    x = torch.randn(2, 3, 4)

    def compiled_calls(grad: bool, compiling: bool = False) -> int:
        log.clear()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
        with torch.set_grad_enabled(grad):
            model.norm.forward(x)
        return len(log)

    assert compiled_calls(grad=True) == 1
    assert compiled_calls(grad=False) == (1 if lengths_vary else 0)
    assert compiled_calls(grad=True, compiling=True) == 0
    assert compiled_calls(grad=False, compiling=True) == 0
    assert marked == ([((2, 3, 4), 0), ((2, 3, 4), 1)] * 2 if lengths_vary else [])


# ---------------------------------------------------------------- pretrain


def test_command_line_overrides_keep_zero_and_map_to_their_recipe_keys():
    """--checkpoint_every 0 (no step cadence) is an override like any other value, under checkpoint.every_steps;
    unset flags are left out. [fails if: falsy values are dropped, or the flag maps to another key]"""
    from engine.pretrain import overrides, parse_args

    args = parse_args(["--deepspeed_config", "x.json", "--checkpoint_every", "0", "--max_steps", "7", "--resume"])
    assert overrides(args) == {"checkpoint.every_steps": 0, "train.max_steps": 7, "resume": True}
    assert overrides(parse_args(["--deepspeed_config", "x.json"])) == {}


def test_auto_batch_is_wanted_when_either_size_says_auto():
    """[fails if: only the micro-batch's "auto" is looked at]"""
    from engine.pretrain import auto_wanted

    assert auto_wanted({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"})
    assert auto_wanted({"train_micro_batch_size_per_gpu": "auto"})
    assert not auto_wanted({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2})
    assert not auto_wanted({})


def preflight_of(tmp_path, *args, recipe: str | None = None):
    from engine.parallel import World
    from engine.pretrain import parse_args, preflight

    argv = ["--deepspeed_config", str(args[0]), "--run_dir", str(tmp_path / "run"), *map(str, args[1:])]
    if recipe is not None:
        (tmp_path / "r.yaml").write_text(recipe)
        argv += ["--config", str(tmp_path / "r.yaml")]
    return preflight(parse_args(argv), World(0, 1, 1))


def test_preflight_accepts_the_edges_of_its_ranges(tmp_path):
    """--memory_fraction 1 (the whole GPU) is valid; a vocabulary exactly the tokenizer's size (483) is enough;
    train.balance_rate 0 needs no expert_parallel section. [fails if: the fraction's range excludes 1, the
    vocabulary check is `>=`, or the balance check fires at a rate of 0]"""
    recipe = TINY.replace("vocab_size: 512", "vocab_size: 483").replace("balance_rate: 0.01", "balance_rate: 0")
    ds = write_ds(tmp_path / "ds.json", drop=("expert_parallel",))
    r, cfg, tok = preflight_of(tmp_path, ds, "--memory_fraction", "1", recipe=recipe)
    assert r.model.vocab_size == len(tok) == 483 and r.train.balance_rate == 0
    assert "expert_parallel" not in cfg


def test_preflight_refuses_a_zero_memory_fraction_and_leaves_resume_checks_until_the_rest_is_fixed(tmp_path):
    """--memory_fraction 0 is outside (0, 1] (0 is not "unset"); with another problem present, --resume's checks of
    the checkpoint are not run (their lines would follow from the broken input). [fails if: the fraction is checked
    only when truthy, or the resume checks run alongside other problems]"""
    with pytest.raises(ConfigError) as e:
        preflight_of(tmp_path, ZERO3, "--memory_fraction", "0")
    assert "--memory_fraction (0.0) must be in (0, 1]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        preflight_of(tmp_path, ZERO3, "--memory_fraction", "2", "--resume")
    assert "--memory_fraction (2.0) must be in (0, 1]" in str(e.value) and "--resume" not in str(e.value), e.value
    with pytest.raises(ConfigError, match="--resume: no checkpoint in"):
        preflight_of(tmp_path, ZERO3, "--resume")  # alone, it is checked


def test_grad_stats_report_the_norm_and_skipped_steps():
    """[fails if: skipped_steps is left out of the row, or a missing norm is written as None]"""
    from engine.pretrain import grad_stats

    assert grad_stats(NS(get_global_grad_norm=lambda: torch.tensor(2.5), skipped_steps=3)) == {
        "skipped_steps": 3, "grad_norm": 2.5}
    assert grad_stats(NS(get_global_grad_norm=lambda: None)) == {"skipped_steps": 0}
    assert grad_stats(NS()) == {"skipped_steps": 0}


def test_a_data_stop_names_the_step_it_could_not_read_and_the_one_saved():
    """[fails if: the saved step is not the one before the unread step]"""
    from engine.pretrain import DataStop

    e = DataStop(ConfigError("bad row 9"), 7, saved=True)
    assert str(e) == "bad row 9 (reading the data of step 7; saved step 6, continue with --resume once it is fixed)"
    assert (e.step, e.saved) == (7, True)
    assert str(DataStop(None, 3)) == "None (reading the data of step 3)"


def test_zero_step_averages_the_micro_batches_and_steps_after_each():
    """One optimizer step over `accum` micro-batches: the mean of their losses, the data position of the last, one
    backward and one engine.step() per micro-batch (DeepSpeed applies the update on the last). [fails if: the
    losses are summed, not averaged, or engine.step is not called per micro-batch]"""
    from engine.pretrain import zero_step

    calls = []
    losses = iter([1.0, 3.0])

    class Engine:
        device = "cpu"

        def __call__(self, input_ids, labels):
            assert torch.equal(input_ids, labels)
            return NS(loss=torch.tensor(next(losses), requires_grad=True))

        def backward(self, loss):
            calls.append(("backward", loss.item()))

        def step(self):
            calls.append(("step",))

    batches = iter([(5, torch.ones(2, 4, dtype=torch.long)), (9, torch.zeros(2, 4, dtype=torch.long))])
    position, loss = zero_step(Engine(), batches, 2, 0)
    assert position == 9 and loss.item() == 2.0 and not loss.requires_grad
    assert calls == [("backward", 1.0), ("step",), ("backward", 3.0), ("step",)]


def test_gathered_problems_name_each_other_ranks_host_once(monkeypatch):
    """Each distinct problem once, rank 0's without a prefix, another rank's with its rank, host and how many other
    ranks had the same; no problem anywhere is None; a world of one needs no collective. [fails if: the prefix goes
    to rank 0, the other-ranks count is off by one, repeats are not counted, or a world of one gathers]"""
    import torch.distributed as dist

    from engine.parallel import World
    from engine.pretrain import gather_problems

    others = [("hostB", "disk full"), ("hostC", "disk full"), None]
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine, *others]))
    monkeypatch.setattr(socket, "gethostname", lambda: "hostA")
    w = World(0, 4, 4)
    assert gather_problems(w, ConfigError("bad recipe")) == "bad recipe; rank 1 on hostB (and 1 other ranks): disk full"
    others[:] = [None, ("hostC", "disk full"), None]
    assert gather_problems(w, None) == "rank 2 on hostC: disk full"
    others[:] = [None, None, None]
    assert gather_problems(w, None) is None

    def no_collective(*a):
        raise AssertionError("a world of one gathered")

    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    assert gather_problems(World(0, 1, 1), ConfigError("x")) == "x" and gather_problems(World(0, 1, 1), None) is None


def test_start_ranks_alone_prints_its_problem_and_a_refusing_rank_joins_its_peers(monkeypatch):
    """A world of one with a problem prints it and stops without joining anyone; a refusing rank of several joins
    through fail_together and only rank 0 prints; without a problem the ranks start. [fails if: a world of one goes
    through fail_together, or ranks other than 0 print]"""
    import engine.pretrain as pretrain
    from engine.parallel import World

    seen = []
    monkeypatch.setattr(pretrain, "print_error", lambda line: seen.append(("print", line)))
    monkeypatch.setattr(pretrain, "init_distributed", lambda **k: seen.append(("init",)))
    monkeypatch.setattr(pretrain, "fail_together", lambda world, problem: seen.append(("join",)) or f"all: {problem}")
    monkeypatch.setattr(pretrain, "gather_problems", lambda world, problem: None)
    assert pretrain.start_ranks(World(0, 1, 1), ConfigError("bad")) is False
    assert seen == [("print", "error: bad")]
    seen.clear()
    assert pretrain.start_ranks(World(1, 2, 2), ConfigError("bad")) is False
    assert seen == [("join",)]
    seen.clear()
    assert pretrain.start_ranks(World(0, 1, 1), None) is True and seen == [("init",)]


def test_report_error_from_rank_0_and_each_other_nodes_first_rank_only(monkeypatch):
    """[fails if: every rank prints, whatever its LOCAL_RANK]"""
    import engine.pretrain as pretrain
    from engine.parallel import World

    seen = []
    monkeypatch.setattr(pretrain, "print_error", seen.append)
    pretrain.report_error(ValueError("boom"), World(0, 4, 2))
    monkeypatch.setenv("LOCAL_RANK", "0")
    pretrain.report_error(ValueError("boom"), World(2, 4, 2))
    monkeypatch.setenv("LOCAL_RANK", "1")
    pretrain.report_error(ValueError("boom"), World(3, 4, 2))
    assert seen == ["error: boom", f"error on {socket.gethostname()} (rank 2): boom"]


def test_a_refusing_rank_whose_rendezvous_fails_says_its_own_problem(monkeypatch):
    """fail_together: a bad peer timeout turns the watchdog off for the join (the problem already says why), and a
    rendezvous that fails with torch's RuntimeError (DistNetworkError) gives this rank's own problem. [fails if:
    RuntimeError is not caught]"""
    import engine.pretrain as pretrain
    from engine.parallel import World
    from engine.watchdog import PeerTimeoutError

    got = {}

    def bad_timeout():
        raise PeerTimeoutError("bad timeout")

    def init(**k):
        got.update(k)
        raise RuntimeError("DistNetworkError: connection refused")

    monkeypatch.setattr(pretrain, "peer_timeout", bad_timeout)
    monkeypatch.setattr(pretrain, "init_distributed", init)
    assert pretrain.fail_together(World(1, 2, 2), ConfigError("mine")) == "mine"
    assert got == {"watchdog": False, "timeout_s": pretrain.FAIL_TOGETHER_S}


def fake_two_ranks(monkeypatch, other: dict, world_size: int = 2):
    """torch.distributed as seen by one rank of a job whose other rank resolved `other` (a DS config and its
    local_size): all_reduce(MAX) takes the elementwise maximum with that rank's tensor."""
    import torch.distributed as dist

    from engine.ds_config import ep_size

    mine = [other["train_micro_batch_size_per_gpu"], other.get("gradient_accumulation_steps", 1), ep_size(other),
            other["local_size"]]
    theirs = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)

    def all_reduce(t, op):
        if world_size == 1:
            raise AssertionError("a world of one reduced")
        t.copy_(torch.maximum(t, theirs))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world_size)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)


def test_ranks_that_resolved_different_batches_or_expert_sizes_are_refused(monkeypatch):
    """check_ranks_agree: the micro-batch and the accumulation are compared (each alone), then the expert-parallel
    size, naming the nodes' differing rank counts; a world of one compares nothing. [fails if: the accumulation is
    not compared, the nodes' note is dropped, or a world of one reduces]"""
    from engine.parallel import World
    from engine.pretrain import check_ranks_agree

    ep = {"expert_parallel": {"enabled": True, "autoep_size": 2}}
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, **ep}
    fake_two_ranks(monkeypatch, {**ds, "local_size": 2})
    check_ranks_agree(ds, World(0, 4, 2))  # the same everywhere
    fake_two_ranks(monkeypatch, {**ds, "gradient_accumulation_steps": 2, "local_size": 2})
    with pytest.raises(ConfigError, match=r"different batch sizes \(micro-batch 8-8, accumulation 1-2\)"):
        check_ranks_agree(ds, World(0, 4, 2))
    fake_two_ranks(monkeypatch, {**ds, "train_micro_batch_size_per_gpu": 4, "local_size": 2})
    with pytest.raises(ConfigError, match=r"micro-batch 4-8, accumulation 1-1"):
        check_ranks_agree(ds, World(0, 4, 2))
    fake_two_ranks(monkeypatch, {**ds, "expert_parallel": {"enabled": True, "autoep_size": 4}, "local_size": 4})
    with pytest.raises(ConfigError) as e:
        check_ranks_agree(ds, World(0, 6, 2))
    assert "expert_parallel.autoep_size (2-4) (the nodes run 2 to 4 ranks: the hostfile's slots differ)" in str(e.value)
    fake_two_ranks(monkeypatch, {**ds, "local_size": 2}, world_size=1)
    check_ranks_agree(ds, World(0, 1, 1))


def test_memory_fraction_is_applied_only_when_given_on_cuda(monkeypatch):
    """[fails if: a missing --memory_fraction is passed to torch as None on CUDA]"""
    import deepspeed.accelerator

    from engine.pretrain import apply_memory_fraction

    set_to = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_to.append)
    for kind in ("cuda", "cpu"):
        monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda kind=kind: NS(device_name=lambda: kind))
        apply_memory_fraction(None)
        apply_memory_fraction(0.5)
    assert set_to == [0.5]


def test_peak_memory_on_the_cpu_is_the_peak_rss_in_gib():
    """On the CPU accelerator: the process's peak RSS (ru_maxrss, KiB on Linux) in GiB. [fails if: the KiB are
    divided by 2**30]"""
    from engine.pretrain import peak_memory_gib

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    got = peak_memory_gib()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert round(before, 3) <= got <= round(after, 3) and got > 0.05  # this process holds torch: > 50 MiB


def test_a_rows_loss_is_the_mean_over_its_steps_and_its_tokens_count_every_step(monkeypatch):
    """train()'s loop with fakes for the engine, the data, the checkpoint cadence and the metrics file: logging
    every 2 of 5 steps, the steps' losses 1, 3 | 5, 7 | 9 give rows of loss 2, 6 and 9 (each row's mean over the
    steps since the last row; the last row, at max_steps, has one), at steps 2, 4 and 5, the tokens counting
    train_batch_size x seq_len per step. [fails if: a row's summed loss is not divided by its own number of steps
    (or by log_every instead), or the sum is not reset after a row]"""
    import engine.checkpoint
    import engine.pretrain as pretrain
    from engine.config import load_recipe
    from engine.parallel import World

    losses = iter([1.0, 3.0, 5.0, 7.0, 9.0])
    monkeypatch.setattr(pretrain, "zero_step", lambda engine, batches, accum, position: (position + accum,
                                                                                         torch.tensor(next(losses))))

    class Quiet:
        failed, error = False, None

        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):  # fill, fail, close, advance, after_step: nothing to do
            return lambda *a, **k: None

        def agree_failed(self):
            return False

        def due(self, step, max_steps):
            return False, False

        def load_stats(self):
            return {}

    logged = []

    class Rows(Quiet):
        def log(self, row):
            logged.append(row)

    for name in ("ExpertBalance", "ReadAhead"):
        monkeypatch.setattr(pretrain, name, Quiet)
    monkeypatch.setattr(pretrain, "Metrics", Rows)
    monkeypatch.setattr(engine.checkpoint, "Cadence", Quiet)
    monkeypatch.setattr(pretrain, "model_flops_per_token", lambda *a: (1e9,))
    monkeypatch.setattr(pretrain, "peak_tflops", lambda device: None)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: None)
    recipe = load_recipe(None, {"train.max_steps": 5, "train.log_every": 2, "data.seq_len": 16})
    eng = NS(module=NS(config=None), config={}, device="cpu", monitor=None, get_lr=lambda: [0.5],
             train_micro_batch_size_per_gpu=lambda: 3, gradient_accumulation_steps=lambda: 1,
             train_batch_size=lambda: 3)
    rows = pretrain.train(recipe, eng, NS(micro_batches=lambda *a, **k: iter(())), None, World(0, 1, 1))
    assert rows == logged and [r["step"] for r in rows] == [2, 4, 5]
    assert [r["loss"] for r in rows] == [2.0, 6.0, 9.0]
    assert [r["tokens"] for r in rows] == [2 * 3 * 16, 4 * 3 * 16, 5 * 3 * 16] and rows[0]["lr"] == 0.5


def test_a_tokenizer_larger_than_the_loaded_models_vocabulary_is_refused(tmp_path):
    """With model.init_from the vocabulary is the loaded model's: the bundled tokenizer's 483 tokens against a model
    of 480 embeddings is one line naming both and the fix (not "raise model.vocab_size", which a loaded model
    cannot); a model of 483 passes. [fails if: the check is skipped for a loaded model, or compares the recipe's
    vocabulary instead of the loaded one's]"""
    import yaml

    for vocab, ok in ((480, False), (483, True)):
        hf = save_tiny_hf(tmp_path / f"hf{vocab}", vocab)
        r = yaml.safe_load(TINY)
        r["model"] = {"init_from": str(hf)}
        recipe = yaml.safe_dump(r)
        if ok:
            assert preflight_of(tmp_path, ZERO3, recipe=recipe)[0].model.vocab_size == 483
            continue
        with pytest.raises(ConfigError) as e:
            preflight_of(tmp_path, ZERO3, recipe=recipe)
        assert f"has 483 tokens but the model at model.init_from {hf} has a vocabulary of 480" in str(e.value)
        assert "set data.tokenizer to the tokenizer the model was trained with" in str(e.value)


def test_pretraining_takes_the_tokenizer_saved_with_model_init_from(tmp_path):
    """data.tokenizer auto (the default) with model.init_from a Hugging Face directory holding its own tokenizer (490
    tokens) trains with that tokenizer, not the bundled 483-token one; without one there, the bundled one. [fails
    if: auto ignores the model's tokenizer]"""
    import yaml

    for with_tok, want in ((True, 490), (False, 483)):
        hf = save_tiny_hf(tmp_path / f"hf{with_tok}", 490, tokenizer=with_tok)
        r = yaml.safe_load(TINY)
        r["model"] = {"init_from": str(hf)}
        got, _, tok = preflight_of(tmp_path, ZERO3, recipe=yaml.safe_dump(r))
        assert (got.data.tokenizer, len(tok)) == ((str(hf), 490) if with_tok else ("auto", 483))


OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
       "is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.")


@pytest.mark.parametrize("where", ["build", "train", "library", "cublas", "other"])
def test_out_of_memory_is_one_line_naming_the_batch_and_the_fix(monkeypatch, tmp_path, where):
    """bin/pretrain.py: a CUDA out-of-memory error while building the engine or while training ends the run with
    exit 1 and one line: what torch could not allocate and what was free, and the fix for that phase (a config that
    partitions or offloads; the micro-batch written lower, or checkpointing); a CUDA library's own failed allocation
    ("library", "cublas": RuntimeErrors, one of them without the words "out of memory") too; any other RuntimeError is
    not taken for one. [fails if: the error escapes as a
    traceback, the exit is 0, the line names the wrong phase's fix, or every RuntimeError is called out of memory]"""
    import engine.pretrain as pretrain

    lines = []
    monkeypatch.setattr(pretrain, "start_ranks", lambda world, problem: problem is None)
    monkeypatch.setattr(pretrain, "print_error", lines.append)

    error = {"library": RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
             "cublas": RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
             "other": RuntimeError("Expected all tensors to be on the same device")}
    error = error.get(where, torch.OutOfMemoryError(OOM))

    def oom(*a, **k):
        raise error

    if where == "build":
        monkeypatch.setattr(pretrain, "build", oom)
    else:
        monkeypatch.setattr(pretrain, "build", lambda *a: (None, None))
        monkeypatch.setattr(pretrain, "train", oom)
    ds = write_ds(tmp_path / "ds.json", train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2)
    argv = ["--deepspeed_config", str(ds), "--run_dir", str(tmp_path / "run")]
    if where == "other":
        with pytest.raises(RuntimeError, match="same device"):
            pretrain.main(argv)
        return
    rc = pretrain.main(argv)
    assert rc == 1 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("error: out of device memory while ")
    if where in ("library", "cublas"):
        assert line.startswith("error: out of device memory while training at micro-batch 3 x accumulation 2 (peak")
        return
    assert "2.00 GiB wanted, 1.06 GiB free of 79.19 GiB" in line
    if where == "build":
        assert "building the model" in line and "zero2_bf16_states.json" in line and "micro-batch" not in line
    else:
        assert "at micro-batch 3 x accumulation 2" in line and "train_micro_batch_size_per_gpu" in line
        assert "train.activation_checkpointing: true" in line


def test_the_out_of_memory_line_says_what_was_free_without_a_failed_request():
    """torch's message may give the device's capacity and what was free without a "Tried to allocate" (a cache
    reservation, some library paths): the line still says what was free. [fails if: that figure is dropped]"""
    from engine.pretrain import out_of_memory

    e = torch.OutOfMemoryError("CUDA out of memory. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free.")
    line = out_of_memory(e, {"train_micro_batch_size_per_gpu": 2}, True, "")
    assert "at micro-batch 2 x accumulation 1: 1.06 GiB free of 79.19 GiB (peak" in line, line


@pytest.mark.parametrize("where", ["setup", "train", "other"])
def test_grpo_out_of_memory_tells_setup_from_training(monkeypatch, where):
    """bin/grpo.py's main: an out-of-memory error raised inside grpo.setup (the engines and the decoder being built)
    gets the build line; one raised later in the run, the batch line with GRPO's levers; exit 1 either way; any other
    RuntimeError raises as it was. [fails if: the phase is read wrongly (every OOM as training, or as setup), the error
    escapes, or every RuntimeError is called out of memory]"""
    import engine.grpo as grpo
    from engine.config import load_recipe

    lines = []
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}
    monkeypatch.setattr(grpo, "preflight", lambda args, world: (load_recipe(None, {}), ds, None, [], [], None, None))
    monkeypatch.setattr(grpo, "start_ranks", lambda world, problem: True)
    monkeypatch.setattr(grpo, "check_ranks_agree", lambda ds, world: None)
    monkeypatch.setattr(grpo, "print_error", lines.append, raising=False)
    import engine.pretrain as pretrain

    monkeypatch.setattr(pretrain, "print_error", lines.append)

    def setup(*a, **k):
        if where == "other":
            raise RuntimeError("Expected all tensors to be on the same device")
        raise torch.OutOfMemoryError(OOM)

    class Run:  # what setup built; the run's first use of it runs out of memory
        def __getattr__(self, name):
            setup()

    monkeypatch.setattr(grpo, "setup", setup if where == "setup" else lambda *a, **k: Run())
    if where == "other":
        with pytest.raises(RuntimeError, match="same device"):
            grpo.main(["--deepspeed_config", "unused.json"])
        assert lines == []
        return
    rc = grpo.main(["--deepspeed_config", "unused.json"])
    assert rc == 1 and len(lines) == 1, lines
    if where == "setup":
        assert "while building the model" in lines[0]
    else:
        assert "at micro-batch 8 x accumulation 4" in lines[0] and "grpo.max_new_tokens" in lines[0]


def test_preflight_settles_auto_checkpointing_with_the_batch(tmp_path, monkeypatch):
    """bin/pretrain.py's preflight hands the ranks a recipe whose train.activation_checkpointing "auto" is what the
    "auto" batch chose (AutoBatch.checkpointing; off on the CPU), and keeps an explicit false. [fails if: the recipe
    leaves preflight still "auto" (the build would then never checkpoint), or the batch's choice overrides false]"""
    from engine import pretrain
    from engine.auto_batch import AutoBatch

    r, _, _ = preflight_of(tmp_path, ZERO3)
    assert r.train.activation_checkpointing is False  # the CPU: settled, off

    class Checkpointing(AutoBatch):
        def resolve(self, cfg, recipe, dp, device):
            problems = super().resolve(cfg, recipe, dp, device)
            self.checkpointing = True
            return problems

    monkeypatch.setattr(pretrain, "AutoBatch", Checkpointing)
    r, _, _ = preflight_of(tmp_path, ZERO3)
    assert r.train.activation_checkpointing is True
    off = TINY.replace("train:\n", "train:\n  activation_checkpointing: false\n", 1)
    r, _, _ = preflight_of(tmp_path, ZERO3, recipe=off)
    assert r.train.activation_checkpointing is False


def test_memory_stats_count_the_allocators_retries_on_cuda_only(monkeypatch):
    """The metrics rows' memory fields: the peak everywhere, `alloc_retries` (torch.cuda.memory_stats'
    num_alloc_retries) on CUDA only. [fails if: the retries are left out on CUDA, read from another key, or a CPU row
    gets a made-up count]"""
    from types import SimpleNamespace

    import deepspeed.accelerator

    from engine import pretrain

    monkeypatch.setattr(pretrain, "peak_memory_gib", lambda: 1.5)
    assert pretrain.memory_stats() == {"peak_mem_gib": 1.5}  # this machine: the CPU accelerator
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": 7, "num_ooms": 0})
    assert pretrain.memory_stats() == {"peak_mem_gib": 1.5, "alloc_retries": 7}
