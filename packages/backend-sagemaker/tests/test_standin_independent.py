"""The stand-in judges requests on its own: a wrong launcher rule is refused there, not agreed with.

`plan` checks each CreateTrainingJob against botocore's model and SageMaker's documented rules
(`servicemodel`, `javaregex`, `servicerules`). Were the stand-in to reuse those checks, a
mistake in them would pass `plan` and the stand-in alike and every test would stay green. Here
the launcher's rules are made wrong on purpose; the plan lets the request through, and the real
boto3 client's request is still refused by the stand-in with SageMaker's ValidationException.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from conftest import ROLE
from diloco.errors import UserError
from diloco.testing import SLEEP, plan_for
from diloco_sagemaker import javaregex, servicerules, trainingjob
from diloco_sagemaker.executor import SageMakerExecutor
from diloco_sagemaker.testing import patterns, validation
from diloco_sagemaker.testing.api import OPERATIONS
from test_standin import IMAGE, sm

FORTY_DAYS = 40 * 24 * 3600


def planned_job(timeout: float = 3600) -> dict:
    """The one CreateTrainingJob request `plan` makes for a one-replica run."""
    ex = SageMakerExecutor(role=ROLE, image=IMAGE, s3_prefix="s3://diloco-sm/sagemaker")
    (job,) = plan_for(ex, 1, SLEEP, {"seconds": 1}, run_id="wrong-rule", timeout=timeout).body["jobs"]
    return job


def refused_by_the_standin(job: dict) -> str:
    with pytest.raises(ClientError) as err:
        sm().create_training_job(**job)
    assert err.value.response["Error"]["Code"] == "ValidationException"
    return err.value.response["Error"]["Message"]


def test_a_launcher_that_allows_40_day_runtimes_is_refused_by_the_standin(sagemaker, monkeypatch):
    with pytest.raises(UserError, match="MaxRuntimeInSeconds"):  # the launcher's rule, as it is, refuses it
        planned_job(timeout=FORTY_DAYS - 1)
    monkeypatch.setattr(servicerules, "MAX_RUNTIME_SECONDS", FORTY_DAYS)  # wrong: SageMaker's limit is 28 days
    monkeypatch.setattr(trainingjob, "MAX_RUNTIME", FORTY_DAYS)
    job = planned_job(timeout=FORTY_DAYS - 1)
    assert job["StoppingCondition"]["MaxRuntimeInSeconds"] == FORTY_DAYS - 1  # the plan let it through
    assert f"Invalid MaxRuntimeInSeconds: {FORTY_DAYS - 1}" in refused_by_the_standin(job)
    assert sagemaker.received(job["TrainingJobName"]) is None


def test_a_launcher_whose_pattern_check_passes_anything_is_refused_by_the_standin(sagemaker, monkeypatch):
    monkeypatch.setattr(trainingjob, "job_name", lambda run_id, rank, attempt: f"{run_id}_r{rank}")  # wrong: "_"
    with pytest.raises(UserError, match="at 'trainingJobName' failed to satisfy constraint"):
        planned_job()  # the launcher's model check, as it is, refuses the name
    monkeypatch.setattr(javaregex, "full_match", lambda pattern, value: True)  # wrong: every pattern passes
    job = planned_job()
    assert job["TrainingJobName"] == "wrong-rule_r0"  # the plan let it through
    assert ("Value 'wrong-rule_r0' at 'trainingJobName' failed to satisfy constraint: Member must satisfy regular "
            "expression pattern") in refused_by_the_standin(job)
    assert sagemaker.received(job["TrainingJobName"]) is None


def test_the_standin_imports_nothing_of_the_launchers_checks():
    testing = Path(validation.__file__).parent
    imported = set()
    for source in testing.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported |= {f"{'.' * node.level}{node.module or ''}:{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
    launchers = ("servicemodel", "servicerules", "javaregex")
    assert not [i for i in imported if any(name in i for name in launchers)], sorted(imported)


def test_the_standin_keeps_its_own_rules_and_the_bootstraps_hook_name():
    """Beyond the request checks, the stand-in's lifecycles (one instance failing a job of several,
    each instance's resourceconfig.json, host order) are its own too: it imports nothing of the
    launcher but the IAM policy a test holds the launcher to. The one name it shares with the
    bootstrap is its hook for host names on one machine (`containers.HOSTS_ENV`)."""
    from diloco_sagemaker import bootstrap
    from diloco_sagemaker.testing import containers

    testing = Path(containers.__file__).parent
    product = {p.stem for p in testing.parent.glob("*.py")} - {"__init__"}
    reached = set()
    for source in testing.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                reached |= {a.name for a in node.names} if not node.module else {node.module}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diloco_sagemaker."):
                reached.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                reached |= {a.name.split(".")[1] for a in node.names if a.name.startswith("diloco_sagemaker.")}
    assert "permissions" in reached  # the walk sees the stand-in's one import of the launcher
    assert reached & product <= {"permissions"}, sorted(reached & product)
    assert containers.HOSTS_ENV == bootstrap.HOSTS_ENV


def served_patterns() -> set[str]:
    found, seen = set(), set()

    def walk(shape):
        if shape.name not in seen:
            seen.add(shape.name)
            found.update([shape.metadata["pattern"]] if "pattern" in shape.metadata else [])
            for sub in (shape.members.values() if shape.type_name == "structure" else [shape.member]
                        if shape.type_name == "list" else [shape.key, shape.value] if shape.type_name == "map" else []):
                walk(sub)

    for operation in OPERATIONS:
        walk(validation.model().operation_model(operation).input_shape)
    return found


def test_the_standin_reads_every_pattern_of_the_operations_it_serves():
    found = served_patterns()
    assert len(found) > 10
    for pattern in found:
        patterns.compiled(pattern)  # raises Unreadable for one it cannot read


@pytest.mark.parametrize("pattern,value,matches", [
    (r"([\p{L}\p{Z}\p{N}_.:/=+\-@]*)", "team é 9 _.:/=+-@", True),  # Unicode letters, spaces, numbers
    (r"([\p{L}\p{Z}\p{N}_.:/=+\-@]*)", "llm!", False),
    (r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", "my_job", False),  # the whole value
    (r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", "my-job-2", True),
    (r"[\p{Alnum}\-]+", "é", False),  # POSIX classes are US-ASCII
    (r"\w+", "é", False),  # so are \w, \d and \s
    (r"[\S]+", "\u00a0", True),
    (r"a.b", "a\rb", False),  # . excludes every line terminator
    (r"a.b", "a\u2028b", False),
    (r"a.b", "a-b", True),
    (r"([\p{L}]*)${1,128}", "abc", True),  # a quantified anchor
])
def test_the_standin_reads_patterns_as_java_does(pattern, value, matches):
    assert patterns.matches(pattern, value) is matches


@pytest.mark.parametrize("pattern", [r"a\z", r"[\uD800\uDC00-\uDBFF\uDFFF]", r"[a[b]]", r"\p{IsAlphabetic}"])
def test_what_the_standin_cannot_read_is_refused_not_guessed(pattern):
    with pytest.raises(patterns.Unreadable):
        patterns.compiled(pattern)
