"""diloco-core alone must not pull torch, numpy or any cloud SDK.

Meaningful only in an environment that holds nothing but diloco-core and the test tools
(the hatch `core` environment that CI uses sets DILOCO_ISOLATED_ENV=1); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.mark.skipif(not os.environ.get("DILOCO_ISOLATED_ENV"), reason="needs the isolated core environment")
@pytest.mark.parametrize("module", ["torch", "numpy", "boto3", "kubernetes", "modal", "sagemaker"])
def test_heavy_dependency_is_absent(module):
    assert importlib.util.find_spec(module) is None, f"{module} is installed next to diloco-core alone"


@pytest.mark.skipif(not os.environ.get("DILOCO_ISOLATED_ENV"), reason="needs the isolated core environment")
def test_only_local_backend_installed(cli):
    out = cli("backends", check_rc=0).stdout
    assert "local" in out and "eks" not in out and "modal" not in out
