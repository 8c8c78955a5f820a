"""bin/pretrain.py with preflight's data sample made small (start it with the deepspeed launcher):
  SAMPLE_BYTES=N   engine.data_check.SAMPLE_BYTES, so a bad row a few rows into a small file is past the checked
                   head, as it would be deep inside a big corpus
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import data_check, pretrain  # noqa: E402

data_check.SAMPLE_BYTES = int(os.environ["SAMPLE_BYTES"])

if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(pretrain.main())
