"""A Kubernetes stand-in for tests, as strict as an API server: `SimulatedCluster`.

It plays a Kubernetes 1.29 cluster (the oldest the backend supports) on a loopback port, which
the real kubernetes client reaches over HTTP (`api_url`):

- `apiserver`: kmock's API emulator behind an API server's admission: every object created or
  patched is decoded against the 1.29 object model of the official client (`model`, unknown
  fields and wrong types are 400), defaulted (`defaults`) and validated by the API server's
  rules (`rules`, `services`: 422 Invalid, worded as the server's); verbs, parameters and
  fields it does not implement are answered 501 and fail the test;
- `jobcontroller`, `kubelet` and a garbage collector (in `cluster`), working through that API:
  Indexed Jobs with per-index and whole-Job backoff, deadlines and TTL; pods run as local
  processes with exactly the env their spec declares, each with its hostname and an /etc/hosts
  that carries the cluster's DNS records of headless Services' pods (`dns`); owner references
  and propagation policies.

Requires the ``testing`` extra (kmock, pytest-asyncio). `model_snapshot` regenerates the model.
"""

from .cluster import SimulatedCluster

__all__ = ["SimulatedCluster"]
