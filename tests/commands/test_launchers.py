"""Tests for scripts/launch_tpu_pod.sh and scripts/slurm_gpu.sbatch.

Fast and offline: no gcloud, no SLURM, no network. The TPU launcher is exercised in
--dry-run mode with a PATH on which there is no gcloud at all, and in real mode against a
stub `gcloud` that records its arguments; the sbatch script is run against a stub `srun`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch_tpu_pod.sh"
SBATCH = REPO / "scripts" / "slurm_gpu.sbatch"
BASH = shutil.which("bash") or "/bin/bash"

REQUIRED = [
    "--name", "my-v5e",
    "--zone", "us-west4-a",
    "--accelerator-type", "v5litepod-16",
    "--runtime-version", "v2-alpha-tpuv5-lite",
]
# Arguments for maxtrain.train, some of them hard to quote.
TRAIN_ARGS = [
    "configs/base.yml",
    "model_name=llama3-8b",
    "run_name=my run",
    "note=it's $HOME; echo pwned *",
    'quote="double"',
    "multi=line1\nline2",
    "base_output_directory=gs://bucket/runs",
]


def _write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def launch(*args: str, path: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the launcher with bash found up front and the given PATH."""
    full_env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "LC_ALL": "C"}
    full_env.update(env or {})
    return subprocess.run(
        [BASH, str(LAUNCH), *args], capture_output=True, text=True, env=full_env, timeout=30
    )


@pytest.fixture
def no_gcloud_path(tmp_path: Path) -> str:
    """A PATH with nothing on it, so certainly no gcloud."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    return str(empty)


def dry_run(path: str, *extra: str, train_args=TRAIN_ARGS) -> list[str]:
    """The command lines (not the # comments) that --dry-run prints."""
    proc = launch(*REQUIRED, "--dry-run", *extra, "--", *train_args, path=path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines and lines[0].startswith("#")
    return [line for line in lines if line and not line.startswith("#")]


def gcloud_calls(lines: list[str], verb: str) -> list[list[str]]:
    """The argv of each `gcloud compute tpus tpu-vm VERB` command in the printed lines."""
    calls = []
    for line in lines:
        words = shlex.split(line)
        # `describe ... >/dev/null 2>&1 || create ...` holds two commands.
        while words:
            cmd, _, rest = _split_at(words, "||")
            if cmd[:5] == ["gcloud", "compute", "tpus", "tpu-vm", verb]:
                calls.append([w for w in cmd if w not in (">/dev/null", "2>&1")])
            words = rest
    return calls


def _split_at(words: list[str], sep: str):
    if sep in words:
        i = words.index(sep)
        return words[:i], sep, words[i + 1 :]
    return words, None, []


# ---- launch_tpu_pod.sh ------------------------------------------------------------------


def test_help(no_gcloud_path):
    proc = launch("--help", path=no_gcloud_path)
    assert proc.returncode == 0, proc.stderr
    for flag in ["--name", "--zone", "--accelerator-type", "--runtime-version", "--project",
                 "--spot", "--repo-dir", "--delete-after", "--dry-run", "-h, --help"]:
        assert flag in proc.stdout
    assert launch("-h", path=no_gcloud_path).stdout == proc.stdout


def test_dry_run_needs_no_gcloud_and_prints_every_step(no_gcloud_path):
    lines = dry_run(no_gcloud_path, "--spot", "--project", "my-proj", "--delete-after")
    for verb in ["describe", "create", "scp", "ssh", "delete"]:
        calls = gcloud_calls(lines, verb)
        assert calls, f"no gcloud ... {verb} printed:\n" + "\n".join(lines)
        for argv in calls:
            assert "--zone=us-west4-a" in argv
            assert "--project=my-proj" in argv
    (create,) = gcloud_calls(lines, "create")
    assert create[5] == "my-v5e"
    assert "--accelerator-type=v5litepod-16" in create
    assert "--version=v2-alpha-tpuv5-lite" in create
    assert "--spot" in create
    # The describe/create pair comes first: reuse the slice if it exists, else create it.
    assert re.match(r"gcloud compute tpus tpu-vm describe my-v5e .*\|\| gcloud compute tpus tpu-vm create ", lines[0])
    # Copy to, install on and run on every worker.
    (scp,) = gcloud_calls(lines, "scp")
    assert "--worker=all" in scp
    install, train = gcloud_calls(lines, "ssh")
    for argv in (install, train):
        assert argv[5] == "my-v5e" and "--worker=all" in argv
    install_cmd = _flag(install, "--command")
    assert "pip install -e ." in install_cmd and "jax[tpu]" in install_cmd
    train_cmd = _flag(train, "--command")
    assert " -m maxtrain.train " in train_cmd
    assert _flag(train, "--output-directory")  # one log file per worker
    # --delete-after puts the delete last.
    assert gcloud_calls(lines[-1:], "delete")


def test_dry_run_spot_project_and_delete_are_optional(no_gcloud_path):
    lines = dry_run(no_gcloud_path)
    (create,) = gcloud_calls(lines, "create")
    assert "--spot" not in create
    assert not any("--project" in line for line in lines)
    assert not gcloud_calls(lines, "delete")


def _flag(argv: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in argv if w.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def test_pass_through_args_survive_both_shells(tmp_path, no_gcloud_path):
    """Copy-paste the printed `ssh --command=...` line into bash; the command it carries is
    then run by a second bash, as on the worker. maxtrain.train must get the exact args."""
    fake_python = _write_exe(
        tmp_path / "fake python3",  # a space in the interpreter path too
        '#!/bin/bash\nprintf "%s\\0" "$PWD" "$@" > "$ARGV_OUT"\n',
    )
    home = tmp_path / "home"
    (home / "maxtrain").mkdir(parents=True)
    lines = dry_run(no_gcloud_path, "--python", str(fake_python))
    (train_line,) = [line for line in lines if "maxtrain.train" in line]

    driver = (
        # Stand-in for gcloud: run the --command payload the way the worker's shell would.
        'gcloud() { local a; for a in "$@"; do case $a in --command=*) bash -c "${a#--command=}";; esac; done; }\n'
        + train_line + "\n"
    )
    out = tmp_path / "argv"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ARGV_OUT": str(out)}
    proc = subprocess.run([BASH, "-c", driver], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    cwd, *argv = out.read_text().split("\0")[:-1]
    assert cwd == str(home / "maxtrain")
    assert argv == ["-m", "maxtrain.train", *TRAIN_ARGS]


def test_arg_with_space_is_quoted_in_printed_command(no_gcloud_path):
    lines = dry_run(no_gcloud_path, train_args=["configs/base.yml", "run_name=my run"])
    (train,) = [shlex.split(line) for line in lines if "maxtrain.train" in line]
    remote = _flag(train, "--command")
    # The remote shell splits it back into exactly these words.
    assert shlex.split(remote)[-4:] == ["-m", "maxtrain.train", "configs/base.yml", "run_name=my run"]
    assert r"run_name=my\ run" in remote  # printf %q quoting


def test_missing_name_is_a_clear_error(no_gcloud_path):
    args = REQUIRED[2:] + ["--dry-run", "--", "configs/base.yml"]
    proc = launch(*args, path=no_gcloud_path)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "missing required flag(s): --name" in proc.stderr
    assert "gcloud" not in proc.stderr


def test_all_missing_flags_are_listed(no_gcloud_path):
    proc = launch("--dry-run", "--", "configs/base.yml", path=no_gcloud_path)
    assert proc.returncode != 0
    assert "--name --zone --accelerator-type --runtime-version" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (REQUIRED + ["--dry-run"], "nothing to run"),
        (REQUIRED + ["--dry-run", "--bogus", "--", "x"], "unknown argument '--bogus'"),
        (REQUIRED + ["--dry-run", "--zone"], "--zone needs a value"),
        (["--name", "Bad_Name"] + REQUIRED[2:] + ["--dry-run", "--", "x"], "not a valid TPU name"),
        (REQUIRED + ["--dry-run", "--repo-ref", "v1", "--", "x"], "--repo-ref only goes with --repo-url"),
        (REQUIRED + ["--dry-run", "--repo-dir", "/nonexistent", "--", "x"], "is not a directory"),
    ],
)
def test_bad_usage_is_a_clear_error(no_gcloud_path, args, message):
    proc = launch(*args, path=no_gcloud_path)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_flag_equals_value_form(no_gcloud_path):
    args = [a for pair in zip(REQUIRED[::2], REQUIRED[1::2]) for a in ["=".join(pair)]]
    proc = launch(*args, "--dry-run", "--", "configs/base.yml", path=no_gcloud_path)
    assert proc.returncode == 0, proc.stderr
    assert "--accelerator-type=v5litepod-16" in proc.stdout


def test_missing_gcloud_is_a_clear_error_outside_dry_run(no_gcloud_path):
    proc = launch(*REQUIRED, "--", "configs/base.yml", path=no_gcloud_path)
    assert proc.returncode != 0
    assert "gcloud not found" in proc.stderr


def test_repo_url_clones_instead_of_copying(no_gcloud_path):
    lines = dry_run(no_gcloud_path, "--repo-url", "https://example.com/maxtrain.git", "--repo-ref", "v0.1")
    assert not gcloud_calls(lines, "scp")
    assert not any(line.startswith("tar ") for line in lines)
    install = _flag(gcloud_calls(lines, "ssh")[0], "--command")
    assert "git clone https://example.com/maxtrain.git" in install
    assert "git fetch origin v0.1" in install


def test_setup_command_and_python_in_home(no_gcloud_path):
    setup = "sudo apt-get install -y python3.11-venv && python3.11 -m venv ~/venv"
    lines = dry_run(no_gcloud_path, "--setup-command", setup, "--python", "~/venv/bin/python")
    install, train = (_flag(argv, "--command") for argv in gcloud_calls(lines, "ssh"))
    assert install.startswith("{ " + setup + "; } && ")
    assert "~/venv/bin/python -m pip install -e ." in install  # ~ left for the worker to expand
    assert "cd ~/maxtrain && ~/venv/bin/python -m maxtrain.train " in train


# Real mode against a stub gcloud: checks the order of the calls and --delete-after.
STUB_GCLOUD = """#!/bin/bash
printf '%s\\0' "$@" >> "$GCLOUD_LOG"; printf '\\n' >> "$GCLOUD_LOG"
case "$4 $*" in
  describe*) [ -n "$STUB_STATE" ] || exit 1; echo "$STUB_STATE" ;;
  "ssh "*maxtrain.train*) exit "${STUB_TRAIN_RC:-0}" ;;
esac
"""


def _real_run(tmp_path: Path, *extra: str, **stub_env: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _write_exe(bin_dir / "gcloud", STUB_GCLOUD)
    log = tmp_path / "gcloud.log"
    log.write_text("")
    env = {"GCLOUD_LOG": str(log), "TMPDIR": str(tmp_path), **stub_env}
    proc = launch(*REQUIRED, "--log-dir", str(tmp_path / "logs"), *extra, "--", *TRAIN_ARGS[:3],
                  path=f"{bin_dir}:{os.environ['PATH']}", env=env)
    calls = [line.split("\0")[:-1] for line in log.read_text().split("\n") if line]
    return proc, [c[3] for c in calls]


def test_real_run_creates_installs_trains_and_deletes(tmp_path):
    proc, verbs = _real_run(tmp_path, "--delete-after")
    assert proc.returncode == 0, proc.stderr
    assert verbs == ["describe", "create", "scp", "ssh", "ssh", "delete"]
    assert (tmp_path / "maxtrain-src-my-v5e.tar.gz").is_file()
    assert (tmp_path / "logs").is_dir()


def test_real_run_reuses_a_ready_slice(tmp_path):
    proc, verbs = _real_run(tmp_path, STUB_STATE="READY")
    assert proc.returncode == 0, proc.stderr
    assert verbs == ["describe", "scp", "ssh", "ssh"]
    assert "reusing TPU 'my-v5e'" in proc.stderr


def test_real_run_refuses_a_slice_that_is_not_ready(tmp_path):
    proc, verbs = _real_run(tmp_path, STUB_STATE="PREEMPTED")
    assert proc.returncode != 0
    assert verbs == ["describe"]
    assert "state 'PREEMPTED'" in proc.stderr


def test_delete_after_runs_even_when_training_fails(tmp_path):
    proc, verbs = _real_run(tmp_path, "--delete-after", STUB_TRAIN_RC="3")
    assert proc.returncode == 3
    assert verbs[-2:] == ["ssh", "delete"]


# ---- slurm_gpu.sbatch -----------------------------------------------------------------


def test_sbatch_directives_parse():
    lines = SBATCH.read_text().splitlines()
    assert lines[0].startswith("#!")
    # sbatch reads #SBATCH lines only up to the first line that is not a comment or blank.
    first_cmd = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert not any(line.startswith("#SBATCH") for line in lines[first_cmd:])
    opts = {}
    for line in lines[:first_cmd]:
        if line.startswith("#SBATCH"):
            m = re.fullmatch(r"#SBATCH --([a-z][a-z-]*)(?:=(\S+))?", line)
            assert m, f"unparseable directive: {line!r}"
            opts[m.group(1)] = m.group(2)
    assert int(opts["nodes"]) >= 2
    # One JAX process per GPU.
    assert opts["ntasks-per-node"] == opts["gpus-per-node"]
    assert "gpus-per-task" not in opts


def test_sbatch_runs_maxtrain_train_under_srun(tmp_path):
    text = SBATCH.read_text()
    assert re.search(r"^srun .*\\\n\s+python -m maxtrain\.train configs/base\.yml \"\$@\"$", text, re.M)
    # Run it for real with a stub srun that records argv and one env var.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "srun.argv"
    _write_exe(bin_dir / "srun", '#!/bin/bash\nprintf "%s\\0" "$XLA_PYTHON_CLIENT_MEM_FRACTION" "$PWD" "$@" > "$SRUN_OUT"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_OUT": str(out),
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "123"}
    proc = subprocess.run([BASH, str(SBATCH), "model_name=llama3-8b", "run_name=a b"],
                          capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    mem_fraction, cwd, *argv = out.read_text().split("\0")[:-1]
    assert float(mem_fraction) > 0
    assert cwd == str(tmp_path)
    assert argv[-6:] == ["python", "-m", "maxtrain.train", "configs/base.yml", "model_name=llama3-8b", "run_name=a b"]


# ---- both scripts -----------------------------------------------------------------------


@pytest.mark.parametrize("script", [LAUNCH, SBATCH], ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", [LAUNCH, SBATCH], ids=lambda p: p.name)
def test_shellcheck(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    proc = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
