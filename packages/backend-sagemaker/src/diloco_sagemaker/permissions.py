"""The IAM permissions the identity running diloco needs for the sagemaker backend, as one policy.

One place for them: the README prints this policy, and the test control plane runs every test
as an IAM user holding exactly it (`diloco_sagemaker.testing`), recording each action a call
needed, so a permission the launcher needs and the list lacks fails a test, and a listed one no
call needs fails another. Why each is needed:

- `sagemaker:CreateTrainingJob`, and `sagemaker:AddTags` because every job is created with
  tags (SageMaker authorizes tags on create as AddTags); `iam:PassRole` on the execution role;
- `sagemaker:DescribeTrainingJob` (status, resume, logs placeholder), `sagemaker:StopTrainingJob` (cancel);
- `s3:PutObject` for the code and for the supervisor's write proof (every 30 s it overwrites one
  small object in the rendezvous store: a full disk refuses writes only); `s3:GetObject` and
  `s3:ListBucket` for the rendezvous store, which the supervisor reads (rounds, results);
- `logs:DescribeLogStreams`, `logs:GetLogEvents` on /aws/sagemaker/TrainingJobs (`diloco logs`);
- `secretsmanager:CreateSecret`, `secretsmanager:PutSecretValue` on `diloco/*`, and
  `secretsmanager:TagResource` because the secret is created with a tag (forwarded secrets only).
"""

from __future__ import annotations

from typing import Any

SAGEMAKER_ACTIONS = ["sagemaker:CreateTrainingJob", "sagemaker:AddTags", "sagemaker:DescribeTrainingJob",
                     "sagemaker:StopTrainingJob"]
S3_OBJECT_ACTIONS = ["s3:PutObject", "s3:GetObject"]
S3_BUCKET_ACTIONS = ["s3:ListBucket"]
LOGS_ACTIONS = ["logs:DescribeLogStreams", "logs:GetLogEvents"]
SECRETS_ACTIONS = ["secretsmanager:CreateSecret", "secretsmanager:PutSecretValue", "secretsmanager:TagResource"]
PASS_ROLE = "iam:PassRole"


def launcher_actions() -> list[str]:
    """Every action in the policy, sorted."""
    return sorted({*SAGEMAKER_ACTIONS, *S3_OBJECT_ACTIONS, *S3_BUCKET_ACTIONS, *LOGS_ACTIONS, *SECRETS_ACTIONS,
                   PASS_ROLE})


def launcher_policy(*, role_arn: str = "arn:aws:iam::<account>:role/<execution role>", bucket: str = "<bucket>",
                    account: str = "<account>", region: str = "<region>") -> dict[str, Any]:
    """The identity policy for the shell that runs `diloco run / status / logs / cancel`."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "TrainingJobs", "Effect": "Allow", "Action": SAGEMAKER_ACTIONS,
         "Resource": f"arn:aws:sagemaker:{region}:{account}:training-job/*"},
        {"Sid": "PassTheExecutionRole", "Effect": "Allow", "Action": PASS_ROLE, "Resource": role_arn,
         "Condition": {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}},
        {"Sid": "CodeAndRendezvous", "Effect": "Allow", "Action": S3_OBJECT_ACTIONS,
         "Resource": f"arn:aws:s3:::{bucket}/*"},
        {"Sid": "ListTheBucket", "Effect": "Allow", "Action": S3_BUCKET_ACTIONS, "Resource": f"arn:aws:s3:::{bucket}"},
        {"Sid": "Logs", "Effect": "Allow", "Action": LOGS_ACTIONS,
         "Resource": f"arn:aws:logs:{region}:{account}:log-group:/aws/sagemaker/TrainingJobs:*"},
        {"Sid": "ForwardedSecrets", "Effect": "Allow", "Action": SECRETS_ACTIONS,
         "Resource": f"arn:aws:secretsmanager:{region}:{account}:secret:diloco/*"},
    ]}
