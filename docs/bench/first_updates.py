"""Why bf16 weights with stochastic rounding (AdamWSR) run ahead of fp32-master AdamW early in a warmup: one process,
CPU, no DeepSpeed, the same init and batches for every variant.

  fp32      fp32 weights, fp32 forward and AdamW: the trajectory the others approximate
  master    bf16 weights for the forward, fp32 master copies updated by AdamW and rounded to the nearest bf16 after
            each step (what DeepSpeed's bf16 ZeRO-1/2 does with fp32 optimizer states: ds_configs/zero2.json)
  sr        bf16 weights and moments, AdamWSR (engine/optim.py; train.stochastic_rounding: auto with
            zero2_bf16_states.json), two noise seeds
  nearest   bf16 weights, AdamW computed in fp32 from them and rounded to the nearest bf16 (DeepSpeed's optimizer
            with zero2_bf16_states.json and stochastic_rounding false)

Early in a linear warmup AdamW moves every weight by about lr (its first step is lr x sign(g)), while a bf16 weight
near 0.02 moves only by whole bf16 steps of 2^-13: the master variant's forward sees a weight change only once the
master has drifted half a step, sr's sees it on average at once. Prints the loss of each step's batch before its
update (as the metrics rows do), each variant's gap to fp32, and the share of the forward's weights the first update
changed.

  python docs/bench/first_updates.py [--steps 30] [--hidden 512] [--layers 4] [--lr 3e-4] [--warmup 100]
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.config import ModelConfig  # noqa: E402
from engine.model import make_hf_config  # noqa: E402
from engine.optim import AdamWSR  # noqa: E402


def batches(n, batch, seq, vocab, seed=0):
    """Zipf-distributed tokens with a repeated phrase per row: a loss that falls steeply in the first steps."""
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, vocab + 1).float() ** 1.1
    out = []
    for _ in range(n):
        x = torch.multinomial(probs, batch * seq, replacement=True, generator=g).view(batch, seq)
        phrase = torch.multinomial(probs, 16, replacement=True, generator=g)
        x[:, : seq // 2] = phrase.repeat(seq // 32)  # the first half of every row repeats one phrase
        out.append(x)
    return out


def loss_of(model, x):
    logits = model(input_ids=x).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def adamw_fp32(p32, g32, state, lr, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """torch.optim.AdamW's arithmetic in fp32 (the update both master variants take)."""
    step = state["step"] = state.get("step", 0) + 1
    m = state.setdefault("m", torch.zeros_like(p32))
    v = state.setdefault("v", torch.zeros_like(p32))
    m.lerp_(g32, 1 - b1)
    v.mul_(b2).addcmul_(g32, g32, value=1 - b2)
    p32.mul_(1 - lr * wd)
    p32.addcdiv_(m, (v / (1 - b2 ** step)).sqrt_().add_(eps), value=-lr / (1 - b1 ** step))


def run(kind, init, data, args, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(init["config"], dtype=torch.float32 if kind == "fp32" else torch.bfloat16)
    model.load_state_dict(init["weights"])
    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone() for p in params] if kind in ("master", "nearest") else None
    states = [dict() for _ in params]
    opt = AdamWSR(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=seed) if kind == "sr" else None
    if kind == "fp32":
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses, changed = [], None
    for step, x in enumerate(data):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)  # engine/parallel.py warmup_cosine, inside the warmup
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        before = [p.detach().clone() for p in params] if step == 0 else None
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        else:
            with torch.no_grad():
                for p, m, s in zip(params, masters, states):
                    if kind == "nearest":
                        m.copy_(p)  # bf16 master weights: the stored weight is the forward's
                    adamw_fp32(m, p.grad.float(), s, lr)
                    p.copy_(m)  # round to nearest
        if before is not None:
            n = sum(p.numel() for p in params)
            changed = sum((p.detach() != b).sum().item() for p, b in zip(params, before)) / n
        losses.append(loss.item())
    return losses, changed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from transformers import AutoModelForCausalLM

    m = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=8, intermediate_size=4 * args.hidden,
                    moe_intermediate_size=args.hidden // 2, num_experts=16, experts_per_token=4, num_shared_experts=2,
                    first_dense_layers=1, vocab_size=args.vocab, kv_lora_rank=128, q_lora_rank=256,
                    qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
    config = make_hf_config(m)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # init in bf16: every variant starts there
    init = {"config": config, "weights": {k: v.clone() for k, v in ref.state_dict().items()}}
    n = sum(p.numel() for p in ref.parameters())
    data = batches(args.steps, args.batch, args.seq, args.vocab)
    runs = {}
    for kind, seed in (("fp32", 0), ("master", 0), ("sr", 0), ("sr", 1), ("nearest", 0)):
        name = kind if kind != "sr" else f"sr{seed}"
        runs[name] = run(kind, init, data, args, seed)
        print(f"# {name}: done (first update changed {runs[name][1]:.1%} of the forward's weights)", flush=True)
    print(f"\n{n / 1e6:.1f}M parameters, initializer_range {config.initializer_range}, lr {args.lr:g} warmup "
          f"{args.warmup} (first step's lr {args.lr / args.warmup:.2g}), {args.batch} x {args.seq} tokens a step\n")
    names = list(runs)
    print("| step | " + " | ".join(names) + " | " + " | ".join(f"{k} - fp32" for k in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for s in range(args.steps):
        row = [runs[k][0][s] for k in names]
        print(f"| {s + 1} | " + " | ".join(f"{v:.4f}" for v in row) + " | "
              + " | ".join(f"{v - row[0]:+.4f}" for v in row[1:]) + " |")
    print("\nweights changed by the first update: " + ", ".join(f"{k} {runs[k][1]:.1%}" for k in names))
    for k in names[1:]:
        gaps = [abs(a - b) for a, b in zip(runs[k][0], runs["fp32"][0])]
        print(f"{k}: mean |gap to fp32| {sum(gaps) / len(gaps):.4f}, largest {max(gaps):.4f} "
              f"(step {gaps.index(max(gaps)) + 1})")


if __name__ == "__main__":
    main()
