"""engine/pipeline.py at unit level, without the launcher: build_pipeline on one process that plays rank r of a
world (deepspeed.comm's rank, world size and groups faked, the real PipelineModule partitioning), on a 3-layer
DeepSeek-V3 (a dense first layer, two MoE layers; Qwen3-MoE for the initialization too). Checked against
transformers itself: the Hugging Face state-dict keys, the ZeRO-3 path's initialization (transformers'
initialize_weights_zero3) and the Hugging Face model's logits. The bracket at the end of a docstring says which bent
rule the test fails on."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

LAYERS = 3


def small_model(attn: str = "eager", arch: str = "deepseek_v3"):
    from engine.config import ModelConfig

    return ModelConfig(arch=arch, hidden_size=32, num_layers=LAYERS, first_dense_layers=1, num_heads=4,
                       num_kv_heads=2, intermediate_size=64, moe_intermediate_size=48, num_experts=4,
                       experts_per_token=2, num_shared_experts=1 if arch == "deepseek_v3" else 0, vocab_size=64,
                       max_position_embeddings=64, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                       v_head_dim=8, attn_implementation=attn)


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, world): deepspeed.comm answers as that rank of that world (no process group is created)."""
    import deepspeed.comm as dist

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: ("group", tuple(ranks)))  # a token

    def use(rank: int, world: int) -> None:
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)

    return use


def build(as_rank, rank=0, stages=1, pipe=None, m=None, seed=3, **kw):
    """build_pipeline for `rank` of a world of `stages` ranks (data-parallel size 1)."""
    from engine.pipeline import build_pipeline

    as_rank(rank, stages)
    return build_pipeline(m or small_model(), {"pipeline": {"stages": stages, **(pipe or {})}}, seed=seed, **kw)


def zero3_reference(m, seed: int) -> nn.Module:
    """The whole model initialized as the ZeRO-3 path's rank 0 does it: transformers' initialize_weights_zero3 (its
    parameter gathering has nothing to gather here) after torch.manual_seed(seed), on the same meta-built model."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import initialize_weights_zero3

    from engine.model import make_hf_config

    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(make_hf_config(m), dtype=torch.float32,
                                                attn_implementation=m.attn_implementation)
    full.to_empty(device="cpu")
    torch.manual_seed(seed)
    initialize_weights_zero3(full)
    return full


def hf_state(module) -> dict[str, torch.Tensor]:
    from engine.pipeline import hf_key

    return {hf_key(k, LAYERS): v for k, v in module.state_dict().items()}


def test_hf_key_examples():
    """The docstring's mapping: 0 -> model.embed_tokens, i in 1..L -> model.layers.{i-1}, L+1 -> model.norm and the
    top-level lm_head. [fails if: an index is off by one, the `layer.` prefix stays, or lm_head/embed get the wrong
    `model.` prefix]"""
    from engine.pipeline import hf_key

    assert hf_key("0.embed_tokens.weight", 3) == "model.embed_tokens.weight"
    assert hf_key("1.layer.self_attn.q_proj.weight", 3) == "model.layers.0.self_attn.q_proj.weight"
    assert hf_key("3.layer.mlp.gate.weight", 3) == "model.layers.2.mlp.gate.weight"
    assert hf_key("4.norm.weight", 3) == "model.norm.weight"
    assert hf_key("4.lm_head.weight", 3) == "lm_head.weight"


def test_stages_hold_the_hf_models_tensors_once_each(as_rank):
    """Over the stages of a 2-stage pipeline, the PipelineModules' state dicts, keys mapped by hf_key, are exactly
    the Hugging Face model's (no missing, extra or duplicated key, same shapes), split where stage_layout (the
    preflight) says. [fails if: hf_key maps a key wrongly, the rotary buffers join the module tree, the partition
    default or the stage count passed to DeepSpeed changes]"""
    from transformers import AutoModelForCausalLM

    from engine.ds_config import PARTITION, stage_layout
    from engine.model import make_hf_config

    with torch.device("meta"):
        want = {k: v.shape for k, v in AutoModelForCausalLM.from_config(make_hf_config(small_model())).state_dict()
                .items()}
    got = {}
    for rank, (start, stop) in enumerate(stage_layout(PARTITION, 2, LAYERS)):
        module = build(as_rank, rank, stages=2)
        assert (module._local_start, module._local_stop) == (start, stop)
        keys = hf_state(module)
        assert not set(keys) & set(got)
        got.update({k: v.shape for k, v in keys.items()})
    assert got == want


def test_a_three_stage_pipeline_uses_the_decoder_layer_partition(as_rank):
    """Without pipeline.partition the stages share the decoder layers evenly (type:DecoderLayerPipe), not all
    layers: 3 decoder layers on 3 stages are one each ([0, 2), [2, 3), [3, 5)); "uniform" would give the last stage
    only the head ([4, 5)). [fails if: the partition default changes]"""
    from engine.ds_config import PARTITION, stage_layout

    layout = stage_layout(PARTITION, 3, LAYERS)
    assert layout != stage_layout("uniform", 3, LAYERS)  # the case tells the two apart
    for rank, bounds in enumerate(layout):
        module = build(as_rank, rank, stages=3)
        assert (module._local_start, module._local_stop) == bounds
        assert sum(type(f).__name__ == "DecoderLayerPipe" for f in module.forward_funcs) == 1


@pytest.mark.parametrize("arch, stages", [("deepseek_v3", 1), ("deepseek_v3", 2), ("deepseek_v3", 3),
                                         ("qwen3_moe", 2)])
def test_every_stage_is_initialized_as_the_zero3_path(as_rank, arch, stages):
    """Each rank initializes only its own stage, yet every tensor equals the ZeRO-3 path's (transformers'
    initialize_weights_zero3 over the whole model from the same seed): the RNG is replayed over the other stages'
    modules in the same order. [fails if: the seed is not set, other stages' modules no longer advance the RNG, the
    visit order or dispatch changes, or a layer index maps to the wrong template (e.g. the last decoder layer taken
    for the head, lm_head left uninitialized)]"""
    m = small_model(arch=arch)
    as_rank(0, 1)  # the reference's rank 0
    want = zero3_reference(m, seed=3).state_dict()
    got = {}
    for rank in range(stages):
        got.update(hf_state(build(as_rank, rank, stages=stages, m=m)))
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad


def test_stage_forward_equals_the_hf_models_logits(as_rank):
    """Embed -> DecoderLayerPipe x L -> Head, then lm_head, give the Hugging Face model's logits for the same
    weights: each layer rebuilds positions (0..T-1 per sequence), rotary embedding and the causal mask itself (eager
    attention: no mask means attending to later tokens). B != T so batch and time cannot be mixed up.
    [fails if: positions come from the batch size, the causal mask or the final norm is dropped, the rotary
    embedding gets other positions]"""
    from transformers import AutoModelForCausalLM

    from engine.model import make_hf_config

    m = small_model("eager")
    module = build(as_rank, m=m)
    hf = AutoModelForCausalLM.from_config(make_hf_config(m), attn_implementation="eager").eval()
    hf.load_state_dict(hf_state(module))
    ids = torch.randint(0, m.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = ids
        for f in module.forward_funcs:
            hidden = f(hidden)
        got = hidden @ module.forward_funcs[-1].lm_head.weight.T
        want = hf(input_ids=ids).logits
    assert got.shape == want.shape == (2, 7, m.vocab_size)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_loss_config_and_moe_layers_of_each_stage(as_rank):
    """The last stage's loss_fn is its Head's loss (the first stage has none); every stage carries the model config
    (AutoEP reads it) and moe_layer_ids, the decoder layers with routed experts (DeepSeek-V3 with one dense first
    layer: 1 and 2). [fails if: loss_fn or config is not set, moe_layer_ids selects the dense layers or is numbered
    from 1]"""
    from engine.pipeline import Head

    first, last = build(as_rank, 0, stages=2), build(as_rank, 1, stages=2)
    head = last.forward_funcs[-1]
    assert isinstance(head, Head) and last.loss_fn == head.loss
    assert first.loss_fn is None
    for module in (first, last):
        assert module.config.model_type == "deepseek_v3" and module.config.n_routed_experts == 4
        assert module.moe_layer_ids == [1, 2]


def test_every_layer_shares_the_stages_config(as_rank):
    """_materialize copies a layer without copying the config (deepcopy memo): every decoder layer's modules
    reference the PipelineModule's own config object, so a change to it (use_cache, AutoEP's reads) is seen by all
    of them. [fails if: _materialize deep-copies the config into every layer]"""
    module = build(as_rank)
    layers = [f for f in module.forward_funcs if type(f).__name__ == "DecoderLayerPipe"]
    assert layers and all(f.config is module.config for f in layers)
    assert all(f.layer.self_attn.config is module.config for f in layers)


def test_rotary_frequencies_stay_fp32_in_a_bf16_stage(as_rank):
    """DeepSpeed casts a bf16 model's buffers to bf16; the rotary inverse frequencies are kept out of the module tree
    so that they stay fp32 (as in the Hugging Face model under ZeRO-3) and out of the state dict.
    [fails if: the rotary embedding is registered as a submodule of DecoderLayerPipe]"""
    module = build(as_rank)
    want = type(module.forward_funcs[1]._rotary[0])(config=module.config).inv_freq
    module.to(torch.bfloat16)
    layers = [f for f in module.forward_funcs if type(f).__name__ == "DecoderLayerPipe"]
    assert len(layers) == LAYERS and not [n for n, _ in module.named_buffers() if "inv_freq" in n]
    assert all(f._rotary[0].inv_freq.dtype == torch.float32 and torch.equal(f._rotary[0].inv_freq, want)
               for f in layers)


@pytest.mark.parametrize("pipe, flag, interval", [({}, False, 0), ({}, True, 1),
                                                  ({"activation_checkpoint_interval": 2}, False, 2),
                                                  ({"activation_checkpoint_interval": 2}, True, 2)])
def test_activation_checkpoint_interval(as_rank, pipe, flag, interval):
    """The recipe's activation_checkpointing recomputes every decoder layer (interval 1) unless the DS config's
    pipeline.activation_checkpoint_interval sets one; neither: no checkpointing. [fails if: the recipe flag is
    ignored, or only applies together with the DS config's interval]"""
    module = build(as_rank, pipe=pipe, activation_checkpointing=flag)
    assert module.activation_checkpoint_interval == interval


def test_only_decoder_layers_are_checkpointable(as_rank):
    """Activation checkpointing may recompute decoder layers, never the embedding (recomputing it would lose its
    gradients) nor the head. [fails if: checkpointable_layers is not restricted to DecoderLayerPipe]"""
    module = build(as_rank, activation_checkpointing=True)
    embed, layer, head = module.forward_funcs[0], module.forward_funcs[1], module.forward_funcs[-1]
    assert module._is_checkpointable([layer])
    assert not module._is_checkpointable([embed]) and not module._is_checkpointable([head])


def test_loss_of_a_micro_batch_without_labelled_tokens_is_zero():
    """A micro-batch whose targets are all -100 (prompt or padding only) has loss 0, not 0/0 = nan, which would
    poison the step's mean. [fails if: the token count is not clamped to at least 1]"""
    from engine.pipeline import Head

    head = Head(nn.LayerNorm(4), nn.Linear(4, 5, bias=False), config=SimpleNamespace())
    nn.init.normal_(head.lm_head.weight)
    labels = torch.full((2, 3), -100)
    labels[:, 0] = 1  # the first token of a sequence is never a target
    loss = head.loss(torch.randn(2, 3, 4), labels)
    assert loss.item() == 0.0


# ------------------------------------------------------------------------------------------------ balance_layout


def _autoep_engine(stage_layers: list[int], moe_layer_ids, ep: bool, config=None):
    """A pipeline engine whose module holds AutoEP layers `<i>.layer.mlp` for the given pipeline indices."""
    module = nn.Module()
    for i in stage_layers:
        pipe_layer = nn.Module()
        pipe_layer.layer = nn.Module()
        pipe_layer.layer.mlp = nn.Module()
        pipe_layer.layer.mlp._is_autoep_layer = True
        pipe_layer.layer.mlp.gate = nn.Linear(2, 2)  # a plain submodule: not a row
        module.add_module(str(i), pipe_layer)
    if moe_layer_ids is not None:
        module.moe_layer_ids = moe_layer_ids
    module.config = config or SimpleNamespace(n_routed_experts=4)
    return SimpleNamespace(module=module, config={"expert_parallel": {"enabled": ep}}, device="cpu")


def test_balance_layout_gives_each_autoep_layers_row_among_all_moe_layers():
    """The last stage of a model whose MoE layers are decoder layers 1, 2, 3 holds pipeline layers 3 and 4
    (decoder layers 2 and 3): rows 1 and 2 of 3; DeepSeek's config names the expert count n_routed_experts, Qwen's
    num_experts. [fails if: the row forgets the embedding's offset, total counts this stage's layers only, a module
    without _is_autoep_layer counts, or n_routed_experts is not read]"""
    from engine.pipeline import balance_layout

    got = balance_layout(_autoep_engine([3, 4], [1, 2, 3], ep=True))
    assert got == {"rows": [1, 2], "total": 3, "num_experts": 4, "device": "cpu"}
    qwen = _autoep_engine([1], [0, 1], ep=True, config=SimpleNamespace(num_experts=8))
    assert balance_layout(qwen) == {"rows": [0], "total": 2, "num_experts": 8, "device": "cpu"}


def test_balance_layout_is_empty_without_a_pipeline_or_without_expert_parallel():
    """No moe_layer_ids (not a pipeline module) or no AutoEP: ExpertBalance gets no arguments.
    [fails if: either condition alone no longer leads to {}]"""
    from engine.pipeline import balance_layout

    assert balance_layout(_autoep_engine([3], [1, 2, 3], ep=False)) == {}
    assert balance_layout(_autoep_engine([3], None, ep=True)) == {}


# ------------------------------------------------------------------------------------------ sums and train_step


def test_sum_over_stages_is_exact_for_large_counts(monkeypatch):
    """Parameter counts beyond 2**24 (every real model) survive the all-reduce exactly: 2 replicas of a stage
    with 2**24 + 1 parameters sum to that count, not 2**24. [fails if: the sum is taken in float32]"""
    from engine import pipeline

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: t.mul_(2))  # 2 data-parallel replicas, 1 stage
    engine = SimpleNamespace(config={"pipeline": {"stages": 1}}, device="cpu",
                             grid=SimpleNamespace(data_parallel_size=2))
    assert pipeline.sum_over_stages(engine, 2.0**24 + 1, 3.0) == (2**24 + 1, 3.0)


def test_train_step_feeds_accum_micro_batches_as_inputs_and_labels():
    """One pipeline step reads exactly `accum` micro-batches (ids used as both inputs and labels, the loss shifts
    them), leaves the next one in the iterator, advances the position by accum and returns train_batch's loss.
    [fails if: a micro-batch too few/many is read, labels differ from the ids, the position moves by 1]"""
    from engine.pipeline import train_step

    seen = []

    def train_batch(pairs):
        seen.extend(pairs)
        return torch.tensor(2.5)

    batches = iter([(i, torch.full((1, 4), i)) for i in range(5)])
    position, loss = train_step(SimpleNamespace(train_batch=train_batch), batches, 3, 6)
    assert position == 9 and loss.item() == 2.5
    assert len(seen) == 3 and all(x is y and torch.equal(x, torch.full((1, 4), i)) for i, (x, y) in enumerate(seen))
    assert [i for i, _ in batches] == [3, 4]
