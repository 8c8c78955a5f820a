#!/usr/bin/env python3
"""bin/grpo.py with train.compile "auto" compiling the policy's parameter-free functions only, never its decoder
layers (what "auto" did under ZeRO-3 before it compiled the layers there): the baseline of that change, run through
docs/bench/grpo_vs_trl.sh as GRPO_SCRIPT=docs/bench/grpo_auto_parameter_free.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine import ds_config, grpo  # noqa: E402

whole = ds_config.grpo_compiles_layers
ds_config.grpo_compiles_layers = grpo.grpo_compiles_layers = lambda c, cfg, dev: c is True and whole(c, cfg, dev)

if __name__ == "__main__":
    from engine.proc import exit_now

    exit_now(grpo.main())
