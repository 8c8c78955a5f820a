"""bin/pretrain.py with test-only hooks, chosen by environment variables (start it with the deepspeed launcher):
  HOOK_STEP_SLEEP=S    sleep S seconds at every step boundary, so a test can kill or signal the run mid-training
  HOOK_DIE_IN_SAVE=N   in the save of step N, once DeepSpeed has written this rank's files and before `latest`
                       moves, SIGKILL the whole process group (launcher and every rank), like a power cut
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

RANK = int(os.environ.get("RANK", "0"))
OUT = os.environ.get("HOOK_OUT")
info: dict = {"rank": RANK}

sleep = float(os.environ.get("HOOK_STEP_SLEEP", "0"))
if sleep:
    due = checkpoint.Cadence.due

    def slow_due(self, step, max_steps):
        time.sleep(sleep)
        return due(self, step, max_steps)

    checkpoint.Cadence.due = slow_due

die_at = os.environ.get("HOOK_DIE_IN_SAVE")
if die_at:
    ds_save = DeepSpeedEngine.save_checkpoint

    def dying_save(self, *args, **kwargs):
        result = ds_save(self, *args, **kwargs)
        if kwargs["client_state"]["step"] == int(die_at):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return result

    DeepSpeedEngine.save_checkpoint = dying_save

load = checkpoint.load


def recording_load(engine, run_dir):
    state = load(engine, run_dir)
    info["resumed"] = state
    info["bias_after_resume"] = {name: b.tolist() for name, b in engine.module.named_buffers()
                                 if name.endswith("e_score_correction_bias")}
    return state


checkpoint.load = recording_load

if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    rc = pretrain.main()
    info["rc"] = rc
    if OUT:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        Path(OUT, f"rank{RANK}.json").write_text(json.dumps(info))
    exit_now(rc)
