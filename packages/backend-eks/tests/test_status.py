"""Mapping Job and pod status to replica status (pure functions)."""

from __future__ import annotations

import pytest

from diloco_eks.status import format_indexes, index_status, parse_indexes, pod_index, waiting_problem


@pytest.mark.parametrize("text, expected", [("", set()), (None, set()), ("3", {3}), ("1,3-5,7", {1, 3, 4, 5, 7}),
                                            ("0-2", {0, 1, 2})])
def test_run_length_indexes(text, expected):
    assert parse_indexes(text) == expected
    assert parse_indexes(format_indexes(expected)) == expected


def job(**status):
    return {"status": status}


@pytest.mark.parametrize("status, index, expected", [
    ({"completedIndexes": "0-2"}, 1, "succeeded"),
    ({"failedIndexes": "1,3-5", "active": 2}, 4, "failed"),
    ({"failedIndexes": "1", "active": 2}, 2, "running"),
    ({"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}, 0, "failed"),
    ({"conditions": [{"type": "Failed", "status": "False"}], "active": 1}, 0, "running"),
    ({"active": 3}, 0, "running"),
    ({}, 0, "pending"),
])
def test_index_status(status, index, expected):
    assert index_status(job(**status), index) == expected


def test_missing_job_is_cancelled():
    assert index_status(None, 0) == "cancelled"


def test_pod_index_annotation_label_or_name():
    ann = {"metadata": {"name": "j-1-abcde", "annotations": {"batch.kubernetes.io/job-completion-index": "3"}}}
    lab = {"metadata": {"name": "j-1-abcde", "labels": {"batch.kubernetes.io/job-completion-index": "2"}}}
    name = {"metadata": {"name": "j-1-abcde"}}
    assert (pod_index(ann, "j"), pod_index(lab, "j"), pod_index(name, "j")) == (3, 2, 1)
    assert pod_index({"metadata": {"name": "other-1-x"}}, "j") is None


def test_image_pull_failures_are_recognised():
    pod = {"status": {"containerStatuses": [{"image": "x", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}}]}}
    assert waiting_problem(pod) == 'ImagePullBackOff: Back-off pulling image "x"'
    assert waiting_problem({"status": {"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}}) is None
