"""The model: a Hugging Face MoE architecture, built so that no rank ever holds all of it.

This file knows the architecture, not the parallelism: `hf_config` maps the recipe onto a transformers
config, and `build_model` constructs it through transformers' DeepSpeed integration, which runs
`deepspeed.zero.Init` (ZeRO-3 partitions each module's parameters as soon as it is built) and
initializes weights properly. DeepSpeed later swaps the MoE blocks for AutoEP layers.
"""
from __future__ import annotations

import contextlib

import torch

from . import head
from .config import ModelConfig


def make_hf_config(m: ModelConfig, tokenizer=None):
    """A transformers config for the recipe's model section."""
    from transformers import AutoConfig

    special = {}
    if tokenizer is not None:
        special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_heads, max_position_embeddings=m.max_position_embeddings,
                  num_experts_per_tok=m.experts_per_token, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta}, **special)
    widths = dict(moe_intermediate_size=m.moe_intermediate_size, intermediate_size=m.intermediate_size)
    head_dim = m.hidden_size // m.num_heads
    if m.arch in ("deepseek_v3", "deepseek_v2"):
        mla = dict(n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts,
                   num_key_value_heads=m.num_heads, first_k_dense_replace=m.first_dense_layers,
                   kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                   qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim, routed_scaling_factor=1.0)
        if m.arch == "deepseek_v2":  # softmax top-k, weights not renormalized (DeepSeek-V2's own routing)
            return AutoConfig.for_model("deepseek_v2", topk_method="greedy", **mla, **widths, **common)
        # topk_method and scoring_func: what transformers' DeepSeek-V3 always does (sigmoid scores, the routing bias);
        # written so that loaders that read them (vLLM, SGLang) keep the trained e_score_correction_bias
        return AutoConfig.for_model("deepseek_v3", head_dim=m.qk_rope_head_dim, n_group=1, topk_group=1,
                                    norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", **mla,
                                    **widths, **common)
    if m.arch == "qwen3_moe":
        return AutoConfig.for_model(
            "qwen3_moe", num_experts=m.num_experts, num_key_value_heads=m.num_kv_heads,
            head_dim=head_dim, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, output_router_logits=False, **widths, **common)
    if m.arch == "mixtral":  # every layer MoE, no shared expert: intermediate_size is the experts' width
        return AutoConfig.for_model("mixtral", num_local_experts=m.num_experts, num_key_value_heads=m.num_kv_heads,
                                    head_dim=head_dim, intermediate_size=m.moe_intermediate_size,
                                    output_router_logits=False, **common)
    if m.arch == "qwen3_5_moe":
        # Gated DeltaNet (linear attention) in three of every four layers, gated full attention in the fourth
        # (transformers' default pattern); the linear layers' heads as the full ones': num_heads value heads,
        # num_kv_heads key heads, head_dim each. One shared expert of num_shared_experts x moe_intermediate_size.
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(m.num_layers)]
        return AutoConfig.for_model(
            "qwen3_5_moe_text", num_experts=m.num_experts, num_key_value_heads=m.num_kv_heads, head_dim=head_dim,
            moe_intermediate_size=m.moe_intermediate_size,
            shared_expert_intermediate_size=m.moe_intermediate_size * m.num_shared_experts,
            linear_num_value_heads=m.num_heads, linear_num_key_heads=m.num_kv_heads, linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim, layer_types=types, output_router_logits=False, **common)
    raise ValueError(f"unknown arch {m.arch}")


def build_model(m: ModelConfig, ds_config: dict, tokenizer=None, dtype: torch.dtype = torch.float32,
                hf_config=None, device=None):
    """Construct (or load, with model.init_from) the model, partitioned from birth under ZeRO-3.

    `ds_config` must stay the config later passed to deepspeed.initialize: transformers reads the ZeRO
    stage from it to decide whether to build under zero.Init. `hf_config` overrides the recipe's model
    section (e.g. to build a twin of an existing model). `device` builds a new model there (ZeRO 0-2: every
    rank holds it all; initializing 2.6B parameters on the CPU costs a minute, on the GPU a second).
    """
    import torch._dynamo  # noqa: F401  (importing it inside zero.Init fails)
    import transformers.generation.utils  # noqa: F401
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)  # transformers only holds a weak reference
    if m.init_from:
        model = AutoModelForCausalLM.from_pretrained(m.init_from, dtype=dtype,
                                                     attn_implementation=m.attn_implementation)
        model.train()  # from_pretrained leaves it in eval mode, where activation checkpointing never runs
    else:
        with torch.device(device) if device else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(hf_config or make_hf_config(m, tokenizer), dtype=dtype,
                                                     attn_implementation=m.attn_implementation)
    model._hf_ds_config = keep_alive
    model.config.use_cache = False
    return head.install(model)  # loss and log-probs without (tokens x vocabulary) logits


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm arithmetic (DeepSeek-V3, Qwen3-MoE, Mixtral): fp32 statistics, weight applied in x's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, mm_config, config) -> torch.Tensor:
    """torchao Float8Linear's matmul (the casts of input and weight to FP8 with their scales, and the FP8 GEMM; its
    backward the same for the gradients): compiled, the amax, scale and cast of each operand fuse into one kernel."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)


def compile_parameter_free(model: torch.nn.Module, lengths_vary: bool = False) -> list[str]:
    """torch.compile the parameter-free arithmetic of the model's layers, leaving every module call eager.

    Compiling a module under ZeRO-3 traces DeepSpeed's gather/release hooks, and DeepSpeed will not compile around
    AutoEP there; plain functions have no hooks. Compiled here (each the same arithmetic as transformers' code): each
    RMSNorm's math, with its weight passed in after ZeRO-3's hook has gathered it; silu(gate) * up of the dense MLP
    and the shared experts; the rotary embedding; train.fp8's Float8Linear matmul (engine/fp8.py; eager, the amax,
    scale and cast of each operand are separate passes, forward and backward). Eager ops read and write the whole activation once per op (RMSNorm
    alone is seven passes, in fp32); each compiled function is one fused kernel forward and one backward. Pretraining
    (fixed lengths) uses the compiled code for calls with autograd on only: its evaluation (no_grad) runs transformers'
    eager code at shapes of its own. GRPO (lengths_vary) uses it for its no-grad passes too (the reference, GRPO's
    reference copy included: engine/grpo.py build_reference; the old log-probs); calls inside another torch.compile
    (the rollout decoder's step) always run the eager code, traced into that compile. The compiled kernels round where
    the eager code does (Inductor's emulate_precision_casts; without it a bf16 model's logits differed from the eager
    ones in 58% of values on the CPU): so GRPO's no-grad passes and its policy pass agree to the bit on the same
    weights, compiled or not, and the ratio of its first iteration is exactly 1. Returns what was patched.
    """
    import sys
    import types

    # Static kernels for pretraining's fixed shapes. lengths_vary (GRPO: a new length every step): every dimension but
    # the last of each input is marked dynamic before the first call, so one trace serves every length; without it a
    # second length recompiles once (on one H200 that made GRPO's ZeRO-3 policy pass at step 2 0.6-0.9 s longer). The
    # last (hidden, head) dimension stays static: RMSNorm reduces over it.
    def compile_(fn):
        return torch.compile(fn, options={"emulate_precision_casts": True})

    norm = compile_(_rms_norm)
    swiglu = compile_(_silu_mul)

    def training(compiled, eager):
        def call(*args, **kwargs):
            if torch.compiler.is_compiling() or not (lengths_vary or torch.is_grad_enabled()):
                return eager(*args, **kwargs)
            if lengths_vary:
                for a in args:
                    if isinstance(a, torch.Tensor):
                        for d in range(a.dim() - 1):
                            torch._dynamo.maybe_mark_dynamic(a, d)
            return compiled(*args, **kwargs)
        call.compiled_parameter_free = True
        return call

    norm, swiglu = training(norm, _rms_norm), training(swiglu, _silu_mul)

    def norm_forward(self, hidden_states):
        return norm(hidden_states, self.weight, self.variance_epsilon)

    def mlp_forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    fp8_mm = None

    def fp8_forward(self, x):
        out = fp8_mm(x, self.weight, self.linear_mm_config, self.config)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    done = set()
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(norm_forward, module)
            done.add(f"{kind} (norm)")
        elif (kind.endswith("MLP") and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj"))
              and type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")):
            module.forward = types.MethodType(mlp_forward, module)
            done.add(f"{kind} (silu(gate) * up)")
        elif kind == "Float8Linear" and hasattr(module, "linear_mm_config"):
            fp8_mm = fp8_mm or training(compile_(_fp8_linear), _fp8_linear)
            module.forward = types.MethodType(fp8_forward, module)
            done.add("Float8Linear (fp8 casts and GEMM)")
    # The attention code calls the rotary functions as globals of its own module: patched there, for this process.
    hf_module = sys.modules[type(model).__module__]
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
        eager = getattr(hf_module, name, None)
        if eager is not None and not getattr(eager, "compiled_parameter_free", False):
            setattr(hf_module, name, training(compile_(eager), eager))
            done.add(f"{name} (rotary)")
    return sorted(done)
