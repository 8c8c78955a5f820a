"""Tiny random-init Hugging Face models of the MoE families the engine takes through model.init_from, saved as a
user's own checkpoint would be (save_pretrained + the bundled tokenizer):
    python tests/scripts/family_models.py OUT_DIR [FAMILY ...]     # -> OUT_DIR/<family>/config.json, ...
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "engine" / "assets" / "tokenizer"

COMMON = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, num_experts_per_tok=2, tie_word_embeddings=False)
FAMILIES = {
    "mixtral": dict(intermediate_size=48, num_local_experts=4),  # intermediate_size: the experts' width
    "deepseek_v2": dict(intermediate_size=64, moe_intermediate_size=48, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8,
                        num_key_value_heads=4),
    "qwen3_5_moe_text": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=48, head_dim=8,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8,
                             layer_types=["linear_attention", "full_attention"]),
}


def save_tiny(family: str, out: Path, seed: int = 0) -> Path:
    """A 2-layer model of `family` (a Hugging Face model_type above): hidden 32, 4 experts top-2 (+ 1 shared expert
    in DeepSeek-V2 and Qwen3.5-MoE; Qwen3.5-MoE's first layer Gated DeltaNet, its second full attention)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]}, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for family in sys.argv[2:] or FAMILIES:
        print(save_tiny(family, out / family))
