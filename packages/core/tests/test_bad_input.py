"""Bad input: one clear line naming the problem, exit code 2, no traceback, nothing recorded."""

from __future__ import annotations

import pytest

from conftest import write_spec

from diloco.errors import UserError

GOOD = 'backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n'


@pytest.mark.parametrize("text, expected", [
    ('backend = "local\nreplicas = 2\n', "not valid TOML"),
    ('backend = "sagemaker"\nreplicas = 2\nentrypoint = "job:main"\n', "pip install diloco-backend-sagemaker"),
    ('backend = "nosuch"\nreplicas = 2\nentrypoint = "job:main"\n', "backend 'nosuch' is not installed"),
    ('backend = "local"\nreplicas = 0\nentrypoint = "job:main"\n', "`replicas` must be at least 1, got 0"),
    ('backend = "local"\nreplicas = -1\nentrypoint = "job:main"\n', "`replicas` must be at least 1, got -1"),
    ('backend = "local"\nreplicas = "four"\nentrypoint = "job:main"\n', "`replicas` must be int, got 'four' (a string)"),
    ('backend = "local"\nreplicas = 2\nentrypoint = "nomodule_here:main"\n', "no module named 'nomodule_here'"),
    ('backend = "local"\nreplicas = 2\nentrypoint = "job:missing"\n', "defines no top-level 'missing'"),
    ('backend = "local"\nreplicas = 2\nentrypoint = "not a function ref"\n', "is not 'module:function'"),
    (GOOD + "timeout = -5\n", "`timeout` must be at least 1"),
    (GOOD + "colour = 'blue'\n", "unknown key `colour`"),
    (GOOD + "[restart]\npolicy = 'sometimes'\n", "`restart.policy` must be one of"),
    (GOOD + "[diloco]\nsync_every = 0\n", "`diloco.sync_every` must be at least 1"),
    (GOOD + "[diloco]\ntransport = 'int3'\n", "`diloco.transport` must be one of"),
    (GOOD + "[diloco]\nsync_every = 50\nfragments = 3\n", "`diloco.fragments` (3) must divide `diloco.sync_every` (50)"),
    (GOOD + "[diloco]\ntopk_density = 0\n", "`diloco.topk_density` must be at least"),
    (GOOD + "rendezvous = 'ftp://x'\n", "`rendezvous` must be a file://, memory://, s3://, gs://, az://"),
    (GOOD + "rendezvous = 'memory://shared'\n", "lives in one process's memory"),
    (GOOD + "[args]\npath = 'x'\n", "`args.path` (exported as PATH) sets PATH"),
    (GOOD + "[args]\nAWS_REGION = 'x'\n", "`args.AWS_REGION` is a cloud credential or store variable; list AWS_REGION in `secrets"),
    (GOOD + "[args]\napi_key = 'sk-123'\n", "`args.api_key` looks like a secret"),
    (GOOD + "[diloco]\nmin_replicas = 2\n", "unknown key `diloco.min_replicas` (allowed: checkpoint_every"),
    (GOOD + "secrets = ['NOT_SET_ANYWHERE_X']\n", "secret NOT_SET_ANYWHERE_X is listed"),
    (GOOD + "[env]\nHF_TOKEN = 'hf_abc'\n", "`env.HF_TOKEN` looks like a secret; list its variable in `secrets"),
    ('replicas = 2\nentrypoint = "job:main"\n[backend]\nname = "local"\nnope = 1\n', "unknown key `backend.nope`"),
    (GOOD + "[metrics]\nsinks = ['wandb']\n", "metric sink 'wandb' is not installed (installed: tensorboard)"),
    (GOOD + "[metrics]\nsinks = 'tensorboard'\n", "`metrics.sinks` must be an array of sink names"),
    (GOOD + "[metrics.mlflow]\nuri = 'x'\n", "[metrics.mlflow] configures a sink not in `metrics.sinks`"),
    (GOOD + "[diloco]\ntotal_steps = 0\n", "`diloco.total_steps` must be at least 1"),
    (GOOD + "[diloco]\nparameters = 'big'\n", "`diloco.parameters` must be int, got 'big' (a string)"),
    ('replicas = 2\nentrypoint = "job:main"\n[backend]\nname = "local"\ngrace_period = -1\n', "grace_period"),
    (GOOD + 'gpu = ""\n', "`gpu` must be a non-empty string, got ''"),
    (GOOD + 'secrets = [""]\n', "`secrets` must be an array of non-empty strings, got ['']"),
    ('backend = 5\nreplicas = 2\nentrypoint = "job:main"\n', "`backend` must be a backend name or a [backend] table"),
    ('replicas = 2\nentrypoint = "job:main"\n[backend]\nroot = "x"\n', "`backend` is a table whose `name` must name"),
])
def test_bad_spec_is_one_line_exit_2(cli, project, state_dir, text, expected):
    import importlib.util

    if "pip install diloco-backend-" in expected and importlib.util.find_spec("diloco_sagemaker"):
        pytest.skip("the backend is installed here (a development venv); the isolated core env checks the hint")
    spec = write_spec(project, text)
    for command in ("dryrun", "run"):  # what passes one passes the other
        proc = cli(command, str(spec))
        assert proc.returncode == 2, (command, proc.stdout + proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (command, proc.stderr)
        assert expected in lines[0], command
        assert "Traceback" not in proc.stdout + proc.stderr
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())


def test_missing_spec_file(cli, tmp_path):
    proc = cli("run", str(tmp_path / "nope.toml"))
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_run_names_the_fix(cli):
    proc = cli("status", "no-such-run")
    assert proc.returncode == 2 and "diloco list" in proc.stderr


def test_dryrun_validates_too(cli, project):
    spec = write_spec(project, 'backend = "local"\nreplicas = "four"\nentrypoint = "job:main"\n')
    proc = cli("dryrun", str(spec))
    assert proc.returncode == 2 and "`replicas` must be int, got 'four' (a string)" in proc.stderr


@pytest.mark.parametrize("args, expected", [
    (("export", "no-such-run", "--out", "m"), "`diloco list` shows the recorded runs"),
    (("export", "Bad_Id", "--out", "m", "--store", "file:///tmp/x"), "'Bad_Id' is not a run id"),
    (("export", "run-1", "--out", "m", "--round", "-1"), "Invalid value for '--round'"),
    (("export", "run-1"), "Missing option '--out'"),
])
def test_export_refuses_in_one_line(cli, tmp_path, args, expected):
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m").exists()


def test_export_without_the_replica_package_says_what_to_install(monkeypatch, tmp_path):
    """diloco-core alone (this suite's environment, or a launcher-only install) cannot read the
    checkpoints: the one line names the package to add."""
    from diloco.observe import exporting

    monkeypatch.setattr(exporting, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"not installed here: pip install diloco-replica$"):
        exporting.export_model("run-1", tmp_path / "m", store=(tmp_path / "store").as_uri())
