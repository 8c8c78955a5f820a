"""Routing replay (layer order, token order, leaving use(), per-layer ids, masked agreement, which layers are MoE),
the balance bias (load window, per-layer ratio, pipeline rows, all-reduced counts, fp32 bias) and AdamWSR's
per-parameter noise, each on a unit without a launcher; the bracket at the end of a docstring says which bent rule
the test fails on."""
import pytest
import torch


# ---------------------------------------------------------------------------------------------------------- routing
def _router(seed=0):
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    torch.manual_seed(seed)
    r = TokenChoiceTopKRouter(dim=16, num_experts=8, num_expert_groups=None, num_limited_groups=None, top_k=2,
                              score_func="sigmoid", route_norm=True, route_scale=2.5, gate_bias=False)
    r.e_score_correction_bias = torch.randn(8) * 0.1
    return r


def _policy(routers):
    """A stand-in policy: model.layers.i.mlp is an AutoEP layer holding routers[i]."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for r in routers:
        block, layer = torch.nn.Module(), torch.nn.Module()
        layer._is_autoep_layer, layer.router = True, r
        block.mlp = layer
        model.model.layers.append(block)
    return model


def _other_ids(live: torch.Tensor, shift: int = 3) -> torch.Tensor:
    """Ids no live router chose: each of the live choice moved by `shift` experts (still k distinct ids)."""
    return (live + shift) % 8


def test_moe_layers_are_in_numeric_layer_order():
    """moe_layers returns the AutoEP layers sorted by their layer number (the order the decoder records in), in
    ascending numeric order, whatever order they were registered in and not lexicographically (2 before 10).
    [fails if: layers sorted in reverse order]"""
    from engine.routing import moe_layers

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleDict()
    for i in (10, 2, 0, 3):  # registered out of order; layer 0 dense
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp._is_autoep_layer = i != 0
        block.mlp.tag = i
        model.model.layers[str(i)] = block
    assert [m.tag for m in moe_layers(model)] == [2, 3, 10]


def test_replayed_routes_follow_the_batch_major_token_order():
    """Routes (B, S, L, k) replay onto the router's B*S tokens flattened batch-major (token b*S + s gets
    routes[b, s]), as the hidden states are flattened; B and S both > 1 so a seq-major flattening is visible.
    [fails if: tokens flattened S-major instead of B-major]"""
    from engine.routing import Router

    r = _router()
    router = Router(_policy([r]))
    B, S = 2, 3
    x = torch.randn(B * S, 16)
    routes = torch.stack([torch.randperm(8)[:2] for _ in range(B * S)]).view(B, S, 1, 2).to(torch.int16)
    with router.use(routes):
        _, ids, counts = r(x)
    assert torch.equal(ids, routes.reshape(B * S, 2).long())
    assert torch.equal(counts.long(), torch.bincount(routes.reshape(-1).long(), minlength=8))


def test_leaving_use_gives_the_router_back_its_own_choice():
    """After a `use(routes)` block ends, forwards are DeepSpeed's own again: the ids, weights and counts equal the
    router's choice before installation, not the (different) routes replayed inside the block.
    [fails if: replay not cleared on leaving use()]"""
    from engine.routing import Router

    r = _router()
    x = torch.randn(5, 16)
    want = r(x)
    router = Router(_policy([r]))
    with router.use(_other_ids(want[1])[:, None, None, :].to(torch.int16)):
        inside = r(x)
    assert not torch.equal(inside[1], want[1])
    after = r(x)
    assert all(torch.equal(a, b) for a, b in zip(after, want))


def test_each_layer_replays_its_own_recorded_ids():
    """With two MoE layers, layer l's router dispatches to routes[:, :, l], not to another layer's ids.
    [fails if: every layer replays layer 0's ids]"""
    from engine.routing import Router

    r0, r1 = _router(0), _router(1)
    router = Router(_policy([r0, r1]))
    x = torch.randn(5, 16)
    ids0 = torch.stack([torch.randperm(8)[:2] for _ in range(5)])
    ids1 = _other_ids(ids0, 4)
    routes = torch.stack([ids0, ids1], 1)[:, None].to(torch.int16)  # (B 5, S 1, L 2, k 2)
    with router.use(routes, record=True):
        got0, got1 = r0(x)[1], r1(x)[1]
        used, _ = router.recorded()
    assert torch.equal(got0, ids0) and torch.equal(got1, ids1)
    assert torch.equal(used[:, 1], ids1)


def test_agreement_leaves_out_masked_tokens_in_every_count():
    """agreement's three numbers (choices equal, tokens with every layer equal, tokens) count only the masked-in
    tokens: a masked-out token whose choices all agree adds nothing to the per-token count either.
    [fails if: token agreement ignores mask]"""
    from engine.routing import agreement

    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # (T 2, L 2, k 2)
    b = torch.tensor([[[1, 0], [2, 4]], [[5, 4], [7, 6]]])  # token 0: one layer of two equal; token 1: both
    assert agreement(a, b, torch.tensor([1, 0])).tolist() == [0.5, 0.0, 1.0]
    assert agreement(a, b, torch.tensor([1, 1])).tolist() == [1.5, 1.0, 2.0]


def test_has_moe_counts_the_first_layer_after_the_dense_ones():
    """first_k_dense_replace = k makes layers 0..k-1 dense and layer k an MoE layer: a 2-layer model with k = 1
    has one MoE layer (and a 1-layer model with k = 0 has one). [fails if: `i > dense` instead of `i >= dense`]"""
    from transformers import DeepseekV3Config

    from engine.routing import has_moe

    assert has_moe(DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1))
    assert has_moe(DeepseekV3Config(num_hidden_layers=1, first_k_dense_replace=0))
    assert not has_moe(DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=2))



@pytest.mark.parametrize("step,only", [(1, []), (2, []), (3, []), (2, [1]), (1, [0, 1])])
def test_has_moe_agrees_with_the_layers_qwen_moe_builds(step, only):
    """Qwen-MoE makes layer i sparse only when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers:
    has_moe says MoE exactly when the built 2-layer model has a sparse block. [fails if: decoder_sparse_step is
    ignored (a model whose every layer is dense that way still reports MoE)]"""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from engine.routing import has_moe

    cfg = Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         shared_expert_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=step,
                         mlp_only_layers=only)
    built = any(isinstance(layer.mlp, Qwen2MoeSparseMoeBlock) for layer in Qwen2MoeForCausalLM(cfg).model.layers)
    assert has_moe(cfg) == built

# ---------------------------------------------------------------------------------------------------------- balance
class _Layer(torch.nn.Module):
    """An AutoEP layer as ExpertBalance sees it: token counts per expert and a router with a routing-bias buffer."""
    _is_autoep_layer = True

    def __init__(self, experts=4, bias_dtype=torch.float32, bias_value=0.0):
        super().__init__()
        self.num_experts = experts
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64))
        self.router = torch.nn.Module()
        self.router.register_buffer("e_score_correction_bias", torch.full((experts,), bias_value, dtype=bias_dtype))


def _model(*layers):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList(layers)
    return m


def test_load_stats_cover_every_step_since_the_last_call():
    """load_stats' ratio is over the expert counts summed over every step since the previous call, not the last
    step's alone: [4,0,0,0] then [0,0,0,4] is [4,0,0,4], max/mean 2. [fails if: load window not accumulated]"""
    from engine.balance import ExpertBalance

    layer = _Layer()
    bal = ExpertBalance(_model(layer), rate=0.0)
    for counts in ([4, 0, 0, 0], [0, 0, 0, 4]):
        layer.tokens_per_expert += torch.tensor(counts)
        bal.after_step()
    assert bal.load_stats() == {"expert_load_max_over_mean": [2.0]}
    assert bal.load_stats() == {}  # reset by the call


def test_load_stats_are_one_ratio_per_layer_over_its_experts():
    """One max/mean ratio per MoE layer, taken over that layer's experts: an even layer gives 1.0, a layer whose
    tokens all went to one of 4 experts gives 4.0. [fails if: load_stats over the wrong axis]"""
    from engine.balance import ExpertBalance

    even, skewed = _Layer(), _Layer()
    bal = ExpertBalance(_model(even, skewed), rate=0.0)
    even.tokens_per_expert += torch.tensor([2, 2, 2, 2])
    skewed.tokens_per_expert += torch.tensor([8, 0, 0, 0])
    bal.after_step()
    assert bal.load_stats() == {"expert_load_max_over_mean": [1.0, 4.0]}


def test_pipeline_rows_place_each_local_layer_in_its_row():
    """Pipeline mode (rows/total): a stage holding only the model's second MoE layer (rows [1] of 2) writes its
    counts into row 1: the stats report it as layer 1 (layer 0 empty) and its bias moves against its own load.
    [fails if: pipeline rows ignored]"""
    from engine.balance import ExpertBalance

    layer = _Layer()
    bal = ExpertBalance(_model(layer), rate=0.01, rows=[1], total=2)
    layer.tokens_per_expert += torch.tensor([3, 1, 0, 0])  # mean 1
    bal.after_step()
    assert torch.allclose(layer.router.e_score_correction_bias, torch.tensor([-0.01, 0.0, 0.01, 0.01]))
    assert bal.load_stats() == {"expert_load_max_over_mean": [0.0, 3.0]}


def test_bias_update_uses_counts_summed_over_ranks(monkeypatch):
    """With torch.distributed initialised the step's counts are all-reduced before the bias update and the stats:
    this rank's [2,0,0,0] plus another rank's [0,0,0,6] is [2,0,0,6] (mean 2), so expert 3, not expert 0, is the
    busy one. (all_reduce is faked: it adds the other rank's counts.) [fails if: counts not all-reduced]"""
    import torch.distributed as dist

    from engine.balance import ExpertBalance

    layer = _Layer()
    bal = ExpertBalance(_model(layer), rate=0.01)
    calls = []

    def all_reduce(t, *args, **kwargs):
        calls.append(t.shape)
        t += torch.tensor([[0.0, 0.0, 0.0, 6.0]])

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    layer.tokens_per_expert += torch.tensor([2, 0, 0, 0])
    bal.after_step()
    assert calls == [torch.Size([1, 4])]
    assert torch.allclose(layer.router.e_score_correction_bias, torch.tensor([0.0, 0.01, 0.01, -0.01]))
    assert bal.load_stats() == {"expert_load_max_over_mean": [3.0]}


def test_a_bf16_routing_bias_is_balanced_in_fp32():
    """With balance_rate > 0 a bf16 routing bias is kept in fp32, so updates far below bf16's resolution (1e-3
    against a step of ~4e-3 at |bias| 1) accumulate exactly: 3 steps move the busy expert by 3e-3. A fourth step
    with another busy expert is balanced on its own load. [fails if: bias kept in the model's dtype, or an update
    reads the load accumulated over earlier steps]"""
    from engine.balance import ExpertBalance

    layer = _Layer(bias_dtype=torch.bfloat16, bias_value=1.0)
    bal = ExpertBalance(_model(layer), rate=1e-3)
    for _ in range(3):
        layer.tokens_per_expert += torch.tensor([4, 0, 0, 0])  # mean 1: expert 0 busy, the others idle
        bal.after_step()
    bias = layer.router.e_score_correction_bias
    assert bias.dtype == torch.float32
    assert torch.allclose(bias.double(), torch.tensor([0.997, 1.003, 1.003, 1.003], dtype=torch.float64), atol=1e-6)
    # each update reads that step's load alone: expert 1 busy now moves 1 down and 0 back up
    layer.tokens_per_expert += torch.tensor([0, 4, 0, 0])
    bal.after_step()
    assert torch.allclose(bias.double(), torch.tensor([0.998, 1.002, 1.004, 1.004], dtype=torch.float64), atol=1e-6)


# ------------------------------------------------------------------------------------------------------------ optim
def test_parameters_with_the_same_values_draw_different_rounding_noise():
    """The rounding noise is seeded by the parameter as well as by (seed, rank, step): two bf16 parameters with the
    same values and gradients, in one optimizer, round differently (independent noise, not one shared draw).
    [fails if: seed ignores the parameter index]"""
    from engine.optim import AdamWSR

    torch.manual_seed(0)
    w0, g = torch.randn(4096).bfloat16(), torch.randn(4096).bfloat16()
    p, q = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt = AdamWSR([p, q], lr=1e-3, seed=1)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    assert not torch.equal(p, w0)  # the step moved them
    differ = (p != q).float().mean().item()
    assert differ > 0.05, differ  # measured ~0.1-0.3 on the original; 0 when the noise is shared
