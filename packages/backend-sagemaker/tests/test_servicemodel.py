"""Requests checked against botocore's SageMaker model, in SageMaker's words (no AWS)."""

from __future__ import annotations

import pytest

from diloco_sagemaker import javaregex, servicemodel


def model_patterns() -> set[str]:
    model, found, seen = servicemodel.service_model(), set(), set()

    def walk(shape):
        if shape.name in seen:
            return
        seen.add(shape.name)
        if "pattern" in shape.metadata:
            found.add(shape.metadata["pattern"])
        for sub in (shape.members.values() if shape.type_name == "structure" else
                    [shape.member] if shape.type_name == "list" else
                    [shape.key, shape.value] if shape.type_name == "map" else []):
            walk(sub)

    for name in model.operation_names:
        if model.operation_model(name).input_shape is not None:
            walk(model.operation_model(name).input_shape)
    return found


def test_every_pattern_of_the_model_is_read_as_java_reads_it():
    patterns = model_patterns()
    assert len(patterns) > 100
    untranslated = []
    for p in patterns:
        try:
            javaregex.translate(p)
        except javaregex.UnsupportedPattern as exc:
            untranslated.append(str(exc))
    assert untranslated == []


@pytest.mark.parametrize("pattern,value,matches", [
    (r"([\p{L}\p{Z}\p{N}_.:/=+\-@]*)", "team é 9 _.:/=+-@", True),  # Unicode letters and spaces
    (r"([\p{L}\p{Z}\p{N}_.:/=+\-@]*)", "llm!", False),
    (r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", "my_job", False),  # applied to the whole value
    (r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", "my-job-2", True),
    (r"arn:[\p{Alnum}\-]+:lambda:[\p{Alnum}\-]+:[0-9]{12}:function:.*",
     "arn:aws:lambda:us-east-1:123456789012:function:f", True),
    (r"[\p{Alnum}]+", "é", False),  # POSIX classes are US-ASCII in Java
    (r"[\u0020-\uD7FF\uE000-\uFFFD\uD800\uDC00-\uDBFF\uDFFF\t]*", "ok \U0001F600", True),  # surrogate pairs
    (r"[\u0020-\uD7FF\uE000-\uFFFD\uD800\uDC00-\uDBFF\uDFFF\t]*", "\x01", False),
    (r"([\p{L}\p{Z}\p{N}_.:\/=+\-@]*)${1,128}", "abc", True),  # a quantified anchor
])
def test_java_patterns(pattern, value, matches):
    assert javaregex.full_match(pattern, value) is matches


VALID = {"TrainingJobName": "ok", "RoleArn": "arn:aws:iam::123456789012:role/r",
         "OutputDataConfig": {"S3OutputPath": "s3://b/o"},
         "AlgorithmSpecification": {"TrainingInputMode": "File", "TrainingImage": "i"},
         "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
         "StoppingCondition": {"MaxRuntimeInSeconds": 60}}


def constraint(*path: str) -> dict:
    shape = servicemodel.service_model().operation_model("CreateTrainingJob").input_shape
    for name in path:
        shape = shape.members[name] if shape.type_name == "structure" else shape.member
    return shape.metadata


def test_messages_name_the_member_path_and_the_constraint_as_sagemaker_does():
    assert not servicemodel.check("CreateTrainingJob", VALID)
    keep_alive_max = constraint("ResourceConfig", "KeepAlivePeriodInSeconds")["max"]  # 3600, 21600 in later models
    req = {**VALID, "TrainingJobName": "bad_name",
           "ResourceConfig": {**VALID["ResourceConfig"], "KeepAlivePeriodInSeconds": keep_alive_max + 1},
           "AlgorithmSpecification": {**VALID["AlgorithmSpecification"], "ContainerArguments": ["x" * 300]},
           "Environment": {"OK": "1", "BIG": "y" * 513}, "Tags": [{"Key": "k", "Value": "v!"}]}
    problems = servicemodel.check("CreateTrainingJob", req)
    assert problems.serialization == []
    name_pattern = constraint("TrainingJobName")["pattern"]
    assert problems.message().startswith(f"5 validation errors detected: Value 'bad_name' at 'trainingJobName' "
                                         f"failed to satisfy constraint: Member must satisfy regular expression "
                                         f"pattern: {name_pattern}; ")
    text = "; ".join(problems.validation)
    assert f"Value '{keep_alive_max + 1}' at 'resourceConfig.keepAlivePeriodInSeconds' failed to satisfy " \
           f"constraint: Member must have value less than or equal to {keep_alive_max}" in text
    assert "at 'algorithmSpecification.containerArguments' failed to satisfy constraint: Member must satisfy " \
           "constraint: [Member must have length less than or equal to 256]" in text
    assert "at 'environment' failed to satisfy constraint: Map value must satisfy constraint: [Member must have " \
           "length less than or equal to 512]" in text
    assert "Value 'v!' at 'tags.1.member.value'" in text


def test_required_members_types_and_unknown_members():
    problems = servicemodel.check("CreateTrainingJob", {"TrainingJobName": "j", "Bogus": 1,
                                                        "ResourceConfig": {"InstanceCount": "1"}})
    assert "Value 'null' at 'roleArn' failed to satisfy constraint: Member must not be null" in problems.validation
    assert "Unknown member 'Bogus' at 'CreateTrainingJobRequest'" in problems.serialization
    assert any("'resourceConfig.instanceCount' can not be converted to a Integer" in p for p in problems.serialization)


def test_enums_can_be_left_to_the_service():
    req = {**VALID, "ResourceConfig": {**VALID["ResourceConfig"], "InstanceType": "ml.future.huge"}}
    assert "enum value set" in servicemodel.check("CreateTrainingJob", req).message()
    assert not servicemodel.check("CreateTrainingJob", req, enums=False)
