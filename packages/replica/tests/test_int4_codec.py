"""The int4 transport codec: the bytes of the plain formula, tiny blocks that fp16 cannot scale,
and NaN/Inf that stay non-finite.

`reference_encode`/`reference_decode` are the codec written the plain way (one expression per
step, every temporary made), independent of `codecs`: the product's in-place version must give
the same bytes and the same floats, so the wire format cannot drift with an optimisation.
"""

from __future__ import annotations

import pytest
import torch

from diloco_replica.transport.codecs import decode, encode

BLOCK = 256


def reference_encode(x: torch.Tensor) -> bytes:
    n = x.numel()
    rows = torch.nn.functional.pad(x.float(), (0, (-n) % BLOCK)).view(-1, BLOCK)
    scale = rows.abs().amax(dim=1) / 7
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float16)
    q = (torch.round(rows / scale.float()[:, None]).clamp(-7, 7) + 8).to(torch.uint8).reshape(-1)[:n]
    if n % 2:
        q = torch.cat([q, torch.tensor([8], dtype=torch.uint8)])
    packed = q[0::2] | (q[1::2] << 4)
    return scale.view(torch.int16).numpy().tobytes() + packed.numpy().tobytes()


def reference_decode(payload: bytes, n: int) -> torch.Tensor:
    blocks = -(-n // BLOCK)
    scale = torch.frombuffer(bytearray(payload[:2 * blocks]), dtype=torch.float16).float()
    packed = torch.frombuffer(bytearray(payload[2 * blocks:]), dtype=torch.uint8)
    q = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n].float() - 8
    rows = torch.nn.functional.pad(q, (0, (-n) % BLOCK)).view(-1, BLOCK) * scale[:, None]
    return rows.reshape(-1)[:n]


LENGTHS = [1, 2, 255, 256, 257, 1_000, 4_097, 65_539]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["normal", "half zeros", "wide range"])
def test_bytes_and_floats_are_the_plain_formulas(n, kind):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    if kind == "half zeros":
        x[: n // 2] = 0
    if kind == "wide range":
        x *= torch.logspace(-6, 3, n)
    payload = b"".join(encode(x, "int4"))
    assert payload == reference_encode(x)
    assert torch.equal(decode(payload, "int4", n), reference_decode(payload, n))


@pytest.mark.parametrize("n", [256, 1_000])
def test_a_block_too_small_for_an_fp16_scale_is_still_sent(n):
    """absmax / 7 below fp16's smallest subnormal (a parameter that barely moves at the end of a
    learning-rate decay) used to give a scale of 0, which every reader refuses as corrupt: the
    replica's update would be left out of the round, every round."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-9
    x[:BLOCK] *= 1e-30  # and one block in fp32's subnormal range
    got = decode(b"".join(encode(x, "int4")), "int4", n)
    assert torch.isfinite(got).all()
    assert (got - x).abs().max() <= 2.0 ** -25  # off by at most half the smallest scale


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_makes_its_block_decode_non_finite(bad):
    n = 3 * BLOCK + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    x[BLOCK + 7] = bad
    got = decode(b"".join(encode(x, "int4")), "int4", n)
    finite = torch.isfinite(got).view(-1)
    assert not finite[BLOCK:2 * BLOCK].all()
    assert finite[:BLOCK].all() and finite[2 * BLOCK:].all()
