"""DiLoCo inside trainers people already use, each behind its own extra.

- `integrations.transformers`: `DiLoCoCallback` for ``transformers.Trainer``
  (``pip install "diloco-replica[transformers]"``).
- `integrations.lightning`: `DiLoCoCallback` for ``lightning.Trainer``
  (``pip install "diloco-replica[lightning]"``).

Each module imports its trainer library at import time and, without it, fails with one line
naming the extra to install; diloco-replica alone pulls none of them.
"""
