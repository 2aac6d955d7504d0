"""The sagemaker backend's `[backend]` options: declared once (`SageMakerOptions`), checked here.

Types, bounds and choices are checked by core from the declaration (`diloco.options`), each as
one line naming `backend.KEY`; `check` adds what depends on several keys or on a key's shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from diloco.errors import UserError
from diloco.options import option

MAX_KEEP_ALIVE = 3600  # SageMaker's documented longest warm pool (KeepAlivePeriodInSeconds)
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$")


@dataclass(frozen=True)
class SageMakerOptions:
    """The sagemaker backend's `[backend]` options (see the README for what each maps to)."""

    role: str | None = option(None, help="the execution role ARN the jobs run as; required to launch "
                                         "(a dry run without one still plans)")
    region: str | None = option(None, help="AWS region (default: AWS_REGION or the profile's)")
    image: str | None = option(None, help="an ECR image holding diloco-replica (packages/replica/Dockerfile); "
                                          "or use pytorch_version")
    pytorch_version: str | None = option(None, help="the official SageMaker PyTorch image of this version "
                                                    "(the `images` extra)")
    py_version: str | None = option(None, help='Python of that image, e.g. "py311"')
    pip: list[str] = option([], help="extra pip requirements installed when the job starts")
    instance_type: str | None = option(None, help="overrides the instance type the spec's `gpu` picks")
    volume_size_gb: int = option(100, help="the instance's EBS volume in GB", min=1,
                                 max=16_384)  # SageMaker's largest EBS training volume
    spot: bool = option(False, help="managed spot training")
    max_wait: int | None = option(None, help="seconds a spot job may wait and run in all (default: timeout + 1 h)",
                                  min=1, max=28 * 86_400)  # SageMaker's longest job
    keep_alive: int = option(0, help=f"warm pool seconds (0-{MAX_KEEP_ALIVE}), so a relaunched replica skips "
                                     f"provisioning; not with spot", min=0, max=MAX_KEEP_ALIVE)
    subnets: list[str] = option([], help="VPC subnets (with security_groups)")
    security_groups: list[str] = option([], help="VPC security groups (with subnets)")
    s3_prefix: str | None = option(None, help="where source and outputs go "
                                              "(default: s3://<rendezvous bucket>/diloco-sagemaker)")
    output_path: str | None = option(None, help="the jobs' S3OutputPath (default: <s3_prefix>/<run>/output)")
    include_workdir: bool = option(True, help="upload the spec's workdir as the job's source")
    ignore: list[str] = option([], help="gitignore-style patterns of the workdir never shipped (on top of "
                                        ".gitignore, caches, and credentials, which never ship)")
    tags: dict[str, str] = option({}, help="extra tags on every job")
    secret_refs: dict[str, str] = option({}, help="{ENV_NAME = Secrets Manager ARN} resolved in the container, "
                                                  "never in the request",
                                         not_secrets=True)  # names secrets (HF_TOKEN), holds references

    def check(self) -> None:
        """Everything checkable without AWS beyond types and bounds, each as one line naming the key."""
        if self.role and not _ROLE_ARN.match(self.role):
            raise UserError(f"[backend] role {self.role!r} is not an IAM role ARN "
                            f"(arn:aws:iam::<account>:role/<name>): give the SageMaker execution role")
        if self.image and self.pytorch_version:
            raise UserError("[backend] set `image` or `pytorch_version`, not both")
        if self.spot and self.keep_alive:
            raise UserError("[backend] keep_alive (warm pools) does not work with spot = true on SageMaker; "
                            "drop one of them")
        if bool(self.subnets) != bool(self.security_groups):
            raise UserError("[backend] VPC config needs both `subnets` and `security_groups`")
        from diloco.inputs.specvalues import check_uri
        from diloco.inputs.variables import check_variable

        for prefix_key in ("s3_prefix", "output_path"):
            value = getattr(self, prefix_key)
            if value:  # credentials first: the error below would echo them
                check_uri("[backend]", f"backend.{prefix_key}", value)  # spec tables had this; options given whole
            if value and not value.startswith("s3://"):
                raise UserError(f"[backend] {prefix_key} {value!r} must be an s3:// URI")

        for var, ref in self.secret_refs.items():
            check_variable("[backend]", "backend.secret_refs", var)  # the one reserved list (docs/security.md)
            if not ref:
                raise UserError(f"[backend] secret_refs: {var!r} = {ref!r} must map a variable name to a "
                                f"Secrets Manager secret id or ARN (optionally '#json-key')")
