"""bin/pretrain.py with test-only hooks, chosen by environment variables (start it with the deepspeed launcher, or as
a job of tests/scripts/pool.py: the hooks are taken off again when the run returns):
  HOOK_STEP_SLEEP=S    sleep S seconds at every step boundary, so a test can kill or signal the run mid-training
  HOOK_DIE_IN_SAVE=N   in the save of step N, once DeepSpeed has written this rank's files and before `latest`
                       moves, SIGKILL the whole process group (launcher and every rank), like a power cut
  HOOK_DIE_IN_STEP=N   inside optimizer step N, once ZeRO-3's optimizer has updated the first fp32 sub-group of this
                       rank's partition and before the new values reach the model's parameters, SIGKILL the whole
                       process group
  HOOK_BALANCE=1       record, at every optimizer step, each MoE layer's expert counts (this rank's) and its routing
                       bias before and after ExpertBalance.after_step (in DIR/rank{r}.json under "balance")
  HOOK_OUT=DIR         write DIR/rank{r}.json: main()'s return code, and the routing biases right after --resume
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

from engine import checkpoint, pretrain  # noqa: E402
from engine.balance import ExpertBalance  # noqa: E402


def main() -> int:
    rank, out = int(os.environ.get("RANK", "0")), os.environ.get("HOOK_OUT")
    info: dict = {"rank": rank}
    patched = []

    def patch(owner, name, new):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    sleep = float(os.environ.get("HOOK_STEP_SLEEP", "0"))
    if sleep:
        due = checkpoint.Cadence.due

        def slow_due(self, step, max_steps):
            time.sleep(sleep)
            return due(self, step, max_steps)

        patch(checkpoint.Cadence, "due", slow_due)

    die_at = os.environ.get("HOOK_DIE_IN_SAVE")
    if die_at:
        ds_save = DeepSpeedEngine.save_checkpoint

        def dying_save(self, *args, **kwargs):
            result = ds_save(self, *args, **kwargs)
            if kwargs["client_state"]["step"] == int(die_at):
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return result

        patch(DeepSpeedEngine, "save_checkpoint", dying_save)

    if os.environ.get("HOOK_BALANCE"):
        after_step, info["balance"] = ExpertBalance.after_step, []

        def recording_after_step(self):
            seen = [(layer.tokens_per_expert.tolist(), layer.router.e_score_correction_bias.tolist())
                    for layer in self.layers]
            after_step(self)
            info["balance"].append([{"load": load, "before": before, "after": layer.router.e_score_correction_bias
                                     .tolist()} for (load, before), layer in zip(seen, self.layers)])

        patch(ExpertBalance, "after_step", recording_after_step)

    die_in_step = os.environ.get("HOOK_DIE_IN_STEP")
    if die_in_step:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        ds_step, opt_step, taking = DeepSpeedEngine.step, DeepSpeedZeroOptimizer_Stage3._optimizer_step, {}

        def noting_step(self, *args, **kwargs):
            taking["step"] = self.global_steps + 1  # optimizer steps done so far (a resume restores the count)
            return ds_step(self, *args, **kwargs)

        def dying_optimizer_step(self, sub_group_id):
            result = opt_step(self, sub_group_id)
            if taking.get("step") == int(die_in_step):
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return result

        patch(DeepSpeedEngine, "step", noting_step)
        patch(DeepSpeedZeroOptimizer_Stage3, "_optimizer_step", dying_optimizer_step)

    load = checkpoint.load

    def recording_load(engine, run_dir, lr=None):
        state = load(engine, run_dir, lr)
        info["resumed"] = state
        info["bias_after_resume"] = {name: b.tolist() for name, b in engine.module.named_buffers()
                                     if name.endswith("e_score_correction_bias")}
        return state

    patch(checkpoint, "load", recording_load)
    try:
        rc = pretrain.main()
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    info["rc"] = rc
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"rank{rank}.json").write_text(json.dumps(info))
    return rc


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())
