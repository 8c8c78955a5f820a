"""One Qwen3.5 Gated DeltaNet (transformers PyTorch fallback) compiled on this machine at each sequence length given:
the first compiled call (the compile) against the next and an eager call. `python docs/bench/gdn_compile.py 128 512 2048`"""
import sys, time, torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
torch.manual_seed(0)
cfg = Qwen3_5MoeTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                           linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
m = Qwen3_5MoeGatedDeltaNet(cfg, 0)
for seq in map(int, sys.argv[1:]):
    torch._dynamo.reset()
    f = torch.compile(m.forward, dynamic=False)
    x = torch.randn(2, seq, 64, requires_grad=True)
    t = time.time(); f(hidden_states=x).sum().backward(); first = time.time() - t
    t = time.time(); f(hidden_states=x).sum().backward(); second = time.time() - t
    t = time.time(); m(hidden_states=x).sum().backward(); eager = time.time() - t
    print(f"seq {seq}: chunks {seq // 64}: first compiled call {first:.1f} s, then {second*1e3:.0f} ms (eager {eager*1e3:.0f} ms)", flush=True)
