"""bin/grpo.py (engine.grpo.main, unchanged) recording what a GRPO step makes of its tree rollouts, per rank, in
OUT/rank{r}.json: for every step, what `score` returned (the rewards, and the advantages: per token with trees),
and what `policy_update`, the loss, was given (the rollouts' tree structure, token ids and response mask, and the
advantages it trains on).
usage: deepspeed --num_gpus N tests/scripts/tree_probe.py --out DIR --deepspeed_config ... [grpo args]
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import grpo  # noqa: E402


def main() -> int:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--out" and sys.argv[i] != "--out"]
    steps: list[dict] = []
    score, policy_update = grpo.score, grpo.policy_update

    def score_recorded(run, rows, r, step):
        scores, reward, adv = score(run, rows, r, step)
        steps.append({"step": step, "reward": reward.tolist(), "score_adv_shape": list(adv.shape),
                      "normalize_std": run.g.normalize_std})
        return scores, reward, adv

    def policy_update_recorded(run, r, adv, *a, **k):
        t = r.tree
        steps[-1].update(tree=None if t is None else {"group": t.group, "parents": t.parents, "starts": t.starts,
                                                      "lengths": t.lengths, "generated_tokens": t.generated_tokens},
                         ids=r.ids.tolist(), resp_mask=r.resp_mask.tolist(), p_len=r.p_len, adv=adv.tolist())
        return policy_update(run, r, adv, *a, **k)

    grpo.score, grpo.policy_update = score_recorded, policy_update_recorded
    try:
        rc = grpo.main(argv)
    finally:
        grpo.score, grpo.policy_update = score, policy_update
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"rc": rc, "steps": steps}))
    return rc


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown

    exit_now(main())
