"""The codec arithmetic on the model's GPU (`codecdevice`): where it runs, and the same bytes as the host's.

The placement is a table (runs anywhere). The byte-for-byte comparisons need CUDA: CI has none, so
they are skipped there and `bash scripts/gpu-check` runs them (every test marked `cuda`). They
compare the GPU's results with the host's bit for bit (NaN payloads included), over inputs that
probe each exactly rounded step: ties at .5 of a quantisation level, blocks whose absmax / levels
is inexact, values below fp16's smallest subnormal, all-zero and non-finite blocks, odd lengths.
"""

from __future__ import annotations

import pytest
import torch

from diloco_replica.transport.codecdevice import HOST, placement
from diloco_replica.transport.codecs import INT4_BLOCK, INT8_CHUNK, decode, encode, exact_divisor
from diloco_replica.round.steps.feedback import quantise_pieces_with_feedback, quantise_with_feedback
from diloco_replica.transport.finite import Contribution, accumulate
from diloco_replica.round.streaming import WholeDelta

CUDA = torch.device("cuda:0")


def cuda_test(fn):
    """Marked `cuda` (scripts/gpu-check runs these) and skipped where there is no GPU (CI)."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU; CI has none (bash scripts/gpu-check "
                                                                  "runs it)")(fn)
    return pytest.mark.cuda(fn)


@pytest.mark.parametrize("setting, model_device, transport, where", [
    ("model", "cuda:1", "int4", "cuda:1"),   # the model's own GPU, not the first one
    ("model", "cuda:0", "int8", "cuda:0"),
    ("model", "cuda:0", "bf16", "cuda:0"),
    ("model", "cuda:0", "fp16", "cuda:0"),
    ("model", "cuda:0", "fp32", "cpu"),      # fp32's decode is a view and its fold one add: the host's
    ("model", "cuda:0", "topk", "cpu"),      # topk's sparsification stays on the host
    ("model", "cpu", "int4", "cpu"),         # a model on the host
    ("model", None, "int4", "cpu"),          # a sync process: no model in it
    ("host", "cuda:0", "int4", "cpu"),       # asked for
])
def test_placement(setting, model_device, transport, where):
    assert placement(setting, model_device, transport) == torch.device(where)


def test_an_exact_divisor_on_the_host_is_the_number_itself():
    assert exact_divisor(7, torch.zeros(1)) == 7
    x = torch.tensor([1.0, 2.0, 10.0])
    assert torch.equal(x / exact_divisor(3, x), x / 3)


def test_decoding_on_the_host_by_name_is_the_default_decode():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    for codec in ("fp32", "bf16", "fp16", "int8", "int4"):
        payload = b"".join(encode(x, codec))
        assert same_bits(decode(payload, codec, x.numel(), HOST), decode(payload, codec, x.numel()))


# -- the GPU against the host, bit for bit ------------------------------------------------------

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bit patterns (NaN == NaN, 0.0 != -0.0)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def probes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = 5 * INT8_CHUNK + 77  # odd, and not whole blocks of any codec
    ties = (torch.arange(n, dtype=torch.float32) % 14 - 7) + 0.5  # -6.5 … 6.5: ties at a scale of 1
    ties[::INT4_BLOCK] = 7.0  # absmax 7 per block: scale 1, so each .5 is a tie
    tiny = torch.randn(n, generator=g) * 1e-9  # absmax / 7 below fp16's smallest subnormal
    mixed = torch.randn(n, generator=g) * torch.logspace(-6, 3, n)
    zeros_and_nonfinite = torch.randn(n, generator=g)
    zeros_and_nonfinite[:INT8_CHUNK] = 0.0
    zeros_and_nonfinite[INT8_CHUNK + 3] = float("nan")
    zeros_and_nonfinite[2 * INT8_CHUNK + 5] = float("inf")
    zeros_and_nonfinite[3 * INT8_CHUNK + 9] = -float("inf")
    thirds = torch.full((n,), 1.0) / 3 * torch.arange(1, n + 1)  # absmax / levels inexact in every block
    return {"normal": torch.randn(n, generator=g), "ties": ties, "tiny": tiny, "mixed": mixed,
            "zeros+nonfinite": zeros_and_nonfinite, "thirds": thirds}


@cuda_test
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8", "int4"])
@pytest.mark.parametrize("probe", list(probes()))
def test_the_gpu_encodes_and_decodes_the_hosts_bytes(codec, probe):
    x = probes()[probe]
    host = b"".join(encode(x, codec))
    gpu = b"".join(encode(x.to(CUDA), codec))
    assert gpu == host, f"{codec} {probe}: the GPU's encoding differs from the host's"
    decoded = decode(host, codec, x.numel(), CUDA)
    assert decoded.device.type == "cuda"
    assert same_bits(decoded, decode(host, codec, x.numel())), f"{codec} {probe}: decoded differently"


@cuda_test
@pytest.mark.parametrize("codec", ["int4", "int8", "bf16"])
def test_error_feedback_on_the_gpu_sends_the_hosts_bytes_and_keeps_its_residual(codec):
    g = torch.Generator().manual_seed(3)
    n = 3 * INT8_CHUNK + 11
    pieces = {0: (0, 1000), 1: (1000, 2 * INT8_CHUNK), 2: (2 * INT8_CHUNK, n)}
    residual = {"cpu": torch.zeros(n), "cuda": torch.zeros(n, device=CUDA)}
    for _ in range(3):  # rounds: the residual carries over
        delta = torch.randn(n, generator=g) * 1e-3
        out = {}
        for where, res in residual.items():
            source = WholeDelta(delta.clone())
            out[where] = quantise_pieces_with_feedback(source, res, codec, pieces)
        assert {j: b"".join(p) for j, p in out["cpu"].items()} == {j: b"".join(p) for j, p in out["cuda"].items()}
        assert same_bits(residual["cpu"], residual["cuda"])
    whole = {}
    for where, res in residual.items():  # the whole-Δ form (a snapshot), quantised in place
        d = delta.clone()
        whole[where] = (quantise_with_feedback(d, res, codec, pieces, keep={0, 2}), d)
    assert same_bits(whole["cpu"][1], whole["cuda"][1]) and same_bits(residual["cpu"], residual["cuda"])


@cuda_test
@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0), (1 / 3, 1 / 7, 1 / 50)], ids=["plain", "time-based"])
def test_the_fold_and_the_mean_on_the_gpu_are_the_hosts(scales):
    g = torch.Generator().manual_seed(5)
    n = 100_003
    parts = [torch.randn(n, generator=g) * 10 ** k for k in (-3, 0, 2)]
    totals = {}
    for device in (HOST, CUDA):
        summed = accumulate([Contribution(i, f"k{i}", lambda p=p: p.to(device), s)
                             for i, (p, s) in enumerate(zip(parts, scales))], n, device)
        mean = summed.total.div_(exact_divisor(len(summed.used), summed.total))
        mean.mul_(sum(range(1, 4)) / 3)
        totals[device.type] = mean
    assert same_bits(totals["cpu"], totals["cuda"])
    for codec in ("int4", "int8", "bf16", "fp16"):
        assert b"".join(encode(totals["cuda"], codec)) == b"".join(encode(totals["cpu"], codec))


@cuda_test
def test_a_run_reduced_on_the_gpu_ends_where_one_reduced_on_the_host_does(replicas, store_uri):
    """Rank 0 trains on the GPU and, with codec_device = "model", quantises its Δ and reduces its
    shards there; with "host" it does both on its cores. The same θ_global after every round in
    both runs, so the GPU's bytes are the host's end to end (the published means included). int4
    with error feedback and overlap (the other codecs' steps are compared above, one by one)."""
    settings = {"sync_every": 2, "checkpoint_every": 4, "round_timeout": 30, "exchange": "thread",
                "overlap": True, "transport": "int4"}
    runs = {}
    base = replicas.run_id
    for where in ("model", "host"):
        replicas.run_id = f"{base}-{where}"
        handles = replicas.launch("mlp_rounds", 2, rendezvous=store_uri, settings={**settings, "codec_device": where},
                                  args={"steps": 12, "dim": 64, "cuda_ranks": [0]})
        runs[where] = replicas.results(handles)
    for results in runs.values():
        assert len({r["final"] for r in results}) == 1
    assert runs["model"][0]["hashes"] == runs["host"][0]["hashes"]
