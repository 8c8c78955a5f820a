#!/usr/bin/env python3
"""DeepSpeed 0.19.8 DeepCompile (ZeRO-3) fails on a graph that calls a user Triton kernel: KeyError in list_schedule.

One GPU, no launcher, no files:

    python docs/repro/deepcompile_scatter_add.py --case triton       # 2 Linear layers + scatter_add + a Triton kernel
    python docs/repro/deepcompile_scatter_add.py --case autoep       # a tiny DeepSeek-V3 (transformers) with AutoEP
    python docs/repro/deepcompile_scatter_add.py --case autoep --fix # the same, scheduler made to follow kwargs

Cause (read in deepspeed/compile/list_schedule.py): `get_node_requirements` collects a node's inputs with
`map_arg(node.args, ...)` only. Dynamo records a call of a user Triton kernel as a higher-order op whose tensor inputs
are all keyword arguments (`triton_kernel_wrapper_functional(kernel_idx=..., kwargs={...})`), so the ZeRO-3 scheduler
(`fast_free_schedule`) places that node before the nodes it reads, and `make_graph_from_schedule`'s
`node_copy(node, lambda n: env[n.name])` finds no copy of the input yet: `KeyError: '<input node name>'`. AutoEP's
token permutation runs such a kernel (`deepspeed/moe/ep_kernels.py: _fill_indices_kernel`) on the per-expert token
counts, which `count_tokens_per_expert` builds with `scatter_add_`: hence `KeyError: 'scatter_add'`. `--fix` patches
`get_node_requirements` to follow `node.kwargs` as well (as `deepspeed/compile/util.py: get_last_uses` already does).
Prints one line: REPRODUCED (the KeyError), OK (steps ran), or OTHER (a different failure, with its last lines).
"""
import argparse
import os
import sys
import traceback

import torch

STEPS = 8  # DeepCompile profiles a few eager steps before its passes run: go past them


def fix_scheduler() -> None:
    """list_schedule.get_node_requirements, following keyword arguments too."""
    from torch.fx.node import map_arg
    import deepspeed.compile.list_schedule as ls

    def get_node_requirements(target_node, scheduled):
        scheduled, visited, ordered = set(scheduled), set(), []

        def dfs(node):
            if node in scheduled or node in visited:
                return
            visited.add(node)
            inputs = []
            map_arg((node.args, node.kwargs), inputs.append)
            for n in inputs:
                dfs(n)
            ordered.append(node)

        dfs(target_node)
        return ordered

    ls.get_node_requirements = get_node_requirements


def triton_model():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src_ptr, dst_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = self.a(x)
            idx = h.argmax(-1)
            counts = torch.zeros(64, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))  # as AutoEP counts tokens per expert
            out = torch.empty_like(counts)
            copy_kernel[(1,)](counts, out, 64)  # a user Triton kernel reading the counts
            return (self.b(h).float() * out.float().mean()).pow(2).mean()

    def batch():
        return (torch.randn(128, 64, device="cuda", dtype=torch.bfloat16),)

    return Net(), batch, lambda m, x: m(x)


def autoep_model(ds_config):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, head_dim=16, n_group=1, topk_group=1,
        max_position_embeddings=128, tie_word_embeddings=False)
    autoep_model.keep = HfDeepSpeedConfig(ds_config)  # transformers builds under zero.Init while this lives
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False

    def batch():
        return (torch.randint(0, 256, (4, 64), device="cuda"),)

    return model, batch, lambda m, ids: m(input_ids=ids, labels=ids).loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("triton", "autoep"), default="autoep")
    ap.add_argument("--fix", action="store_true", help="make the scheduler follow keyword arguments")
    args = ap.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(29600 + os.getpid() % 300)))
    import torch._dynamo  # noqa: F401  (before zero.Init)
    import deepspeed

    deepspeed.init_distributed()
    torch.cuda.set_device(0)
    if args.fix:
        fix_scheduler()
    ds_config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
        "compile": {"deepcompile": True},
    }
    if args.case == "autoep":
        ds_config["expert_parallel"] = {"enabled": True, "autoep_size": 1}
        model, batch, loss_fn = autoep_model(ds_config)
    else:
        model, batch, loss_fn = triton_model()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    engine.compile()
    print(f"versions: torch {torch.__version__}, deepspeed {deepspeed.__version__}, case {args.case}, fix {args.fix}",
          flush=True)
    try:
        for step in range(STEPS):
            loss = loss_fn(engine, *batch())
            engine.backward(loss)
            engine.step()
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    except Exception as e:  # noqa: BLE001  (report what happened, in one line, then the traceback's end)
        tb = traceback.format_exc()
        sys.stdout.write("\n".join(tb.splitlines()[-25:]) + "\n")
        kind = "REPRODUCED" if "KeyError" in tb and "list_schedule" in tb else "OTHER"
        why = next((line for line in tb.splitlines() if line.startswith("KeyError")), tb.splitlines()[-1])
        print(f"{kind}: case {args.case}, fix {args.fix}: {type(e).__name__}: {why[:300]}")
        return 1
    print(f"OK: case {args.case}, fix {args.fix}: {STEPS} steps under DeepCompile (ZeRO-3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
