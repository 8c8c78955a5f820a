"""The README's two commands: CI runs exactly the test command; the main-job command trains the default."""
import re
import shlex

from conftest import ROOT, launch, read_metrics

README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_ci_runs_the_readme_test_command():
    main_job, tests = readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_readme_main_job_trains_the_default(tmp_path):
    main_job, _ = readme_commands()
    install, _, job = main_job.partition(" && ")
    assert install == "pip install -e ."  # the set-up half; CI has installed the package already
    argv = shlex.split(job)
    assert argv[0] == "deepspeed" and argv[1] == "bin/pretrain.py"
    launch(1, ROOT / argv[1], *argv[2:], "--run_dir", tmp_path / "run", cwd=ROOT)
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["step"] == 600
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], [r["loss"] for r in rows]
    assert re.fullmatch(r"step_0*600", (tmp_path / "run" / "checkpoints" / "latest").read_text())
