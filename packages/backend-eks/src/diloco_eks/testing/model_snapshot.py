"""Write the Kubernetes API model the stand-in validates against, from an installed official client.

The stand-in plays one API server version, whatever client the tests run with: the oldest
cluster the backend supports (1.29). Reading the installed client's model classes instead would
make it a 1.24 server under the floor client (refusing `backoffLimitPerIndex`, which the default
Job needs) and a newer server under the newest client (accepting fields a 1.29 cluster lacks).
So the model of `kubernetes==29.0.0` (the client generated from the 1.29 OpenAPI) is kept as
data, `kubernetes_1_29.json`: for each model class reachable from the kinds the stand-in
serves, its JSON field names and types (`openapi_types` through `attribute_map`) and the fields
its setters refuse to leave unset (the client's required fields).

Regenerate (needs google-auth, which that client imports):

    pip download kubernetes==29.0.0 --no-deps -d /tmp/k && unzip -q /tmp/k/*.whl -d /tmp/k/site
    PYTHONPATH=/tmp/k/site python -m diloco_eks.testing.model_snapshot > src/diloco_eks/testing/kubernetes_1_29.json
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from typing import Any

# the kinds (and the delete body) the stand-in accepts
ROOTS = ("V1Job", "V1Pod", "V1Secret", "V1Service", "V1DeleteOptions")
_MODEL_REF = re.compile(r"\b(V\d\w+|Core\w+)\b")


def snapshot(roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    """The installed client's model for `roots` and every class they reach, as plain data."""
    import kubernetes
    from kubernetes.client import models

    classes: dict[str, dict[str, Any]] = {}

    def walk(name: str) -> None:
        if name in classes:
            return
        cls = getattr(models, name)
        fields: dict[str, str] = {}
        required: list[str] = []
        classes[name] = {"fields": fields, "required": required}
        for attr, type_name in cls.openapi_types.items():
            json_name = cls.attribute_map[attr]
            fields[json_name] = type_name
            if "must not be `None`" in inspect.getsource(getattr(cls, attr).fset):
                required.append(json_name)
            for ref in _MODEL_REF.findall(type_name):
                walk(ref)

    for root in roots:
        walk(root)
    return {"client": f"kubernetes=={kubernetes.__version__}", "roots": list(roots),
            "models": dict(sorted(classes.items()))}


if __name__ == "__main__":
    json.dump(snapshot(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
