"""Expert routing recorded by the rollout decoder (engine/decoder.py) and replayed by the trainer (engine/routing.py),
in this process on tiny plain Hugging Face models: what the decoder records is what the model itself routes, for
prompt and response tokens, chains and trees; the agreement arithmetic; the refusals. The replay in the trainer
(AutoEP under ZeRO-3 with expert parallelism, 1 and 2 ranks) is tests/test_grpo.py's."""
import pytest
import torch

from conftest import ROOT
from test_grpo_units import tiny_model


def model_routes(model, ids, attn) -> torch.Tensor:
    """(N, T, L, k) the expert ids the Hugging Face model itself picks on a full forward (positions follow the
    left padding, as the decoder's and the trainer's)."""
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
             for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn, position_ids=pos)
    for h in hooks:
        h.remove()
    N, T = ids.shape
    return torch.stack([s.view(N, T, -1) for s in seen], 2)


def loss_positions(attn: torch.Tensor) -> torch.Tensor:
    """Real tokens but each row's last (whose output predicts nothing): the ones whose routing the loss reads."""
    return torch.nn.functional.pad(attn[:, :-1] * attn[:, 1:], (0, 1)).bool()


def same_sets(a, b):
    return (a.sort(-1).values == b.sort(-1).values.to(a.dtype)).all(-1)


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral", "deepseek_v2"])
@pytest.mark.parametrize("experts", ["grouped_mm", "dense"])
def test_the_decoder_records_the_experts_the_model_routes_to(arch, experts):
    """Sampled chains from left-padded prompts, some ending at EOS: the recorded ids of every prompt token and every
    fed response token equal the model's own choice on the finished sequences, in every MoE layer."""
    from engine.decoder import Decoder

    model = tiny_model() if arch == "deepseek_v3" else family_model(arch)
    torch.manual_seed(1)
    ids, mask = torch.randint(3, 512, (3, 6)), torch.ones(3, 6, dtype=torch.long)
    mask[2, :2] = 0
    dec = Decoder(model, "cpu", 4, 32, decode_experts=experts, compile=False, record_routes=True)
    out = dec.generate(ids, mask, 9, eos_id=5, pad_id=0, temperature=1.5)
    attn = torch.cat([mask, (out[:, 6:] != 0).long()], dim=1)  # pad 0 after EOS (never sampled: ids >= 3 here)
    rec = dec.last_routes(*out.shape)
    assert rec.shape == (3, out.shape[1], len(model.model.layers) - dec_dense(model), 2)
    want = model_routes(model, out, attn)
    keep = loss_positions(attn)
    same = same_sets(rec.long(), want)[keep]  # (tokens, L)
    assert same.all(), f"{(~same).sum()} of {same.numel()} choices differ"
    # Not vacuous: the recording differs from a shifted one (a response token's ids put one slot off).
    assert not same_sets(rec[:, 7:-1].long(), want[:, 6:-2])[keep[:, 7:-1]].all()


def dec_dense(model) -> int:
    return sum(not hasattr(layer.mlp, "experts") for layer in model.model.layers)


def family_model(arch):
    from transformers import AutoModelForCausalLM, DeepseekV2Config, MixtralConfig

    torch.manual_seed(0)
    if arch == "deepseek_v2":  # softmax routing, MLA with its own rotary (the decoder: deepseek_v2_cos_sin)
        cfg = DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                               q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                               max_position_embeddings=64, eos_token_id=5, pad_token_id=0)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    cfg = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=64, eos_token_id=5, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_tree_rollouts_carry_their_prefix_routes():
    """Tree rollouts: a forked leaf's shared prefix keeps the ids its source recorded, its own tokens get theirs;
    every leaf's recording equals the model's routing of the leaf's full sequence."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree

    model = tiny_model()
    torch.manual_seed(2)
    ids, mask = torch.randint(3, 512, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    mask[1, :1] = 0
    cfg = TreeConfig(enabled=True, trees=1, branch_points=1, branches=1, iterations=2)
    G = cfg.leaves()
    dec = Decoder(model, "cpu", 2 * G, 5 + 8 * 4, compile=False, record_routes=True)
    out, info = generate_tree(dec, ids, mask, cfg, 8, eos_id=5, pad_id=0, temperature=1.5)
    attn = torch.cat([mask.repeat_interleave(G, 0), (out[:, 5:] != 0).long()], dim=1)
    assert any(p >= 0 for p in info.parents)  # some leaves are forks
    want = model_routes(model, out, attn)
    same = same_sets(info.routes.long(), want)[loss_positions(attn)]
    assert same.all(), f"{(~same).sum()} of {same.numel()} choices differ"


def test_agreement_counts_choices_and_tokens():
    from engine.routing import agreement

    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [2, 3]]])  # (T 3, L 2, k 2)
    b = torch.tensor([[[1, 0], [2, 3]], [[4, 5], [6, 0]], [[7, 6], [5, 4]]])  # order within a choice is irrelevant
    out = agreement(a, b, torch.tensor([1, 1, 0]))
    assert out.tolist() == [1.5, 1.0, 2.0]  # token 0: both layers equal; token 1: one of two; token 2 masked


@pytest.mark.parametrize("overrides, expect", [
    ({"grpo.routing_replay": "r2"}, "grpo.routing_replay: 'r2' is not one of off, r3"),
    ({"grpo.routing_replay": "r3", "grpo.rollout": "engine"},
     "grpo.routing_replay r3 replays the expert choices the rollout decoder records, and grpo.rollout: engine has no "
     "decoder"),
])
def test_bad_replay_settings_are_one_line(overrides, expect):
    from engine.config import ConfigError, load_recipe

    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "engine" / "recipes" / "grpo_tiny.yaml", overrides)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_a_bare_off_in_yaml_is_the_string_off(tmp_path):
    """YAML 1.1 reads `routing_replay: off` (the documented default, and what the refusals say to write) as False."""
    import yaml

    from engine.config import ConfigError, load_recipe

    raw = yaml.safe_load((ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text())
    for word, want in (("off", "off"), ("r3", "r3"), ("on", None)):
        path = tmp_path / f"{word}.yaml"
        path.write_text(yaml.safe_dump(raw) + "")
        text = path.read_text().replace("grpo:\n", f"grpo:\n  routing_replay: {word}\n", 1)
        path.write_text(text)
        if want:
            assert load_recipe(path).grpo.routing_replay == want
        else:
            with pytest.raises(ConfigError, match="grpo.routing_replay: 'on' is not one of off, r3"):
                load_recipe(path)


def test_a_model_without_moe_layers_has_nothing_to_replay():
    from transformers import DeepseekV3Config

    from engine.routing import has_moe

    assert has_moe(tiny_model().config)
    assert not has_moe(DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=2))
    assert not has_moe(DeepseekV3Config(num_hidden_layers=2, n_routed_experts=0))


@pytest.mark.parametrize("score_func, groups, bias", [("sigmoid", None, True), ("sigmoid", 2, True),
                                                      ("softmax", None, False)])
def test_replaying_the_live_choice_is_deepspeeds_router(score_func, groups, bias):
    """On DeepSpeed's own TokenChoiceTopKRouter (sigmoid with DeepSeek's correction bias and group-limited routing;
    softmax as Mixtral/Qwen): replaying the ids it would choose gives exactly its weights, ids and counts, and the
    recorded live choice is its choice; replaying other ids changes the weights, which still carry a gradient."""
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    from engine.routing import Router

    torch.manual_seed(0)
    r = TokenChoiceTopKRouter(dim=16, num_experts=8, num_expert_groups=groups, num_limited_groups=groups and 1,
                              top_k=2, score_func=score_func, route_norm=True, route_scale=2.5, gate_bias=False)
    if bias:
        r.e_score_correction_bias = torch.randn(8) * 0.1
    layer = torch.nn.Module()
    layer._is_autoep_layer, layer.router = True, r
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = layer
    x, expert_bias = torch.randn(5, 16), torch.randn(8) * 0.05
    want = r(x, expert_bias)
    router = Router(model)
    with router.use(None, record=True):
        plain = r(x, expert_bias)
    assert all(torch.equal(a, b) for a, b in zip(plain, want))
    with router.use(want[1][:, None, None, :].to(torch.int16), record=True):  # (B 5, S 1, L 1, k 2)
        got = r(x, expert_bias)
        used, live = router.recorded()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(used[:, 0], want[1]) and torch.equal(live[:, 0], want[1])
    other = (want[1] + 3) % 8
    with router.use(other[:, None, None, :], record=True):
        top, ids, counts = r(x, expert_bias)
        assert torch.equal(router.recorded()[1][:, 0], want[1])  # the live choice is still reported
    assert torch.equal(ids, other) and not torch.allclose(top, want[0]) and counts.sum() == 10
    top.sum().backward()
    assert r.gate.weight.grad.abs().max() > 0
