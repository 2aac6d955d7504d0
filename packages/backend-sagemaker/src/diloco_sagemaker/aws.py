"""Talking to AWS for the sagemaker backend: the region, one boto3 client per service and region,
and AWS's errors turned into one line that names what failed and the fix.

boto3 is imported on first use, never at import (`diloco backends` stays fast).
"""

from __future__ import annotations

import os
import re
from typing import Any

from diloco.errors import BackendError, UserError

from .options import SageMakerOptions


def console_url(region: str, job: str) -> str:
    return f"https://{region}.console.aws.amazon.com/sagemaker/home?region={region}#/jobs/{job}"


def _boto3():
    try:
        import boto3
    except ImportError:  # pragma: no cover - boto3 is a dependency of this package
        raise UserError("the sagemaker backend needs boto3: pip install diloco-backend-sagemaker") from None
    return boto3


class Aws:
    """The AWS side of one executor: clients made once, errors read with the options in mind."""

    def __init__(self, options: SageMakerOptions):
        self.options = options
        self._clients: dict[tuple[str, str], Any] = {}

    def region(self) -> str:
        if self.options.region:
            return self.options.region
        found = os.environ.get("AWS_REGION") or _boto3().session.Session().region_name  # boto3 reads only AWS_DEFAULT_REGION
        if not found:
            raise UserError("no AWS region: set [backend] region = \"us-east-1\" (or AWS_REGION in this shell)")
        return found

    def client(self, service: str, region: str | None = None) -> Any:
        region = region or self.region()
        key = (service, region)
        if key not in self._clients:
            from botocore.config import Config

            self._clients[key] = _boto3().session.Session().client(
                service, region_name=region, config=Config(retries={"mode": "standard", "max_attempts": 8}))
        return self._clients[key]

    def call(self, what: str, fn, *args, **kwargs):
        """One AWS call, with AWS's errors turned into one line that names what failed and the fix."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

        try:
            return fn(*args, **kwargs)
        except NoCredentialsError:
            raise UserError("no AWS credentials found: run `aws configure` or `aws sso login`, or set AWS_PROFILE "
                            "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) in this shell") from None
        except NoRegionError:
            raise UserError("no AWS region: set [backend] region (or AWS_REGION in this shell)") from None
        except ClientError as exc:
            raise self.client_error(what, exc) from None
        except BotoCoreError as exc:
            raise BackendError(f"AWS call failed ({what}): {exc}") from None

    def client_error(self, what: str, exc: Any) -> Exception:
        err = exc.response.get("Error", {})
        code, message = err.get("Code", ""), err.get("Message", str(exc))
        action = f"{exc.operation_name}"
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            return UserError(f"AWS denied {action} ({what}): {message}; allow it for the identity running diloco")
        if code in ("ExpiredToken", "ExpiredTokenException", "UnrecognizedClientException",
                    "InvalidClientTokenId", "InvalidSignatureException"):
            return UserError(f"AWS rejected this shell's credentials ({code}) on {action}: refresh them "
                             f"(`aws sso login`, or new keys)")
        if code == "ValidationException" and "assume" in message.lower():
            return UserError(f"SageMaker cannot assume role {self.options.role}: its trust policy must allow "
                             f"sagemaker.amazonaws.com, and the identity running diloco needs iam:PassRole on it "
                             f"({message})")
        if code == "ResourceLimitExceeded":
            found = re.search(r"ml\.[a-z0-9-]+\.[a-z0-9-]+", f"{message} {what}")
            instance = found.group(0) if found else "the instance type"
            usage = "spot training job usage" if self.options.spot else "training job usage"
            return UserError(f"SageMaker quota reached for {instance}: {message} Request more in Service Quotas "
                             f"('{instance} for {usage}'), or choose another instance type")
        if code in ("ValidationException", "ResourceInUse"):
            return UserError(f"SageMaker rejected {action} ({what}): {message}")
        return BackendError(f"AWS {action} failed ({what}): {code}: {message}")

    def describe(self, md: dict[str, Any]) -> dict[str, Any] | None:
        """DescribeTrainingJob for a handle's metadata; None for a job SageMaker does not know."""
        from botocore.exceptions import ClientError

        sm = self.client("sagemaker", md.get("region"))
        try:
            return sm.describe_training_job(TrainingJobName=md["job"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound") \
                    and "not found" in str(exc).lower():
                return None
            raise self.client_error(f"describe {md['job']}", exc) from None
