"""Transport codecs: an fp32 vector to the bytes on the wire and back to fp32.

Accumulation is always fp32: readers decode to fp32, reducers average in fp32 and re-encode.

    codec  bytes per element                 what it is
    fp32   4                                 exact
    bf16   2                                 truncated mantissa
    fp16   2
    int8   1 + 4/2048                        symmetric absmax scale per 2,048 elements
    int4   0.5 + 2/256                       symmetric absmax scale (fp16) per 256 elements, values -7..7
    topk   ~3 per kept element + 6/4096      sparse: the kept elements of each 4,096-element block
                                             (block-local uint16 index, int8 value, one fp32 scale)

`int4` is Streaming DiLoCo's 4-bit transport (arXiv 2501.18512) with a blockwise scale instead of
E3M0; 256 elements per scale keep the overhead at 1.6%, so a round moves 0.127× the fp32 bytes.

`topk` is SparseLoCo's chunked top-k (arXiv 2508.15706): the replica keeps the `density`
largest-magnitude elements of every 4,096-element block of Δ plus its error-feedback residual
(`sparsify`), and what it does not send stays in the residual for the next round. The payload
lists each block's count, so the format carries any support: a reducer's mean (the union of its
members' supports) is encoded the same way, with no re-sparsification.

Every decode is deterministic, so every replica decodes the same bytes to the same floats. The
same holds on a GPU: `encode` runs where its input lies and `decode` where it is asked to
(`codec_device`), with only operations that are exactly rounded on either (casts, comparisons,
rounding to an integer, one multiply or divide at a time, each division by a tensor: CUDA
divides by a Python number through its reciprocal, which can be one bit off), so a replica that
quantises on its GPU sends the bytes a host would (tests/test_codec_device.py, run where CUDA is).
Decoding checks what a codec's layout allows (block scales positive, topk counts and indices
within their blocks) and raises `BadPayload` otherwise; NaN and Inf survive every encoding, so a
diverged replica's update still decodes non-finite and is caught (`finite`).
"""

from __future__ import annotations

import torch

from diloco.store.wiresize import CODECS, INT4_BLOCK, INT8_CHUNK, TOPK_BLOCK, blocks as _blocks, payload_nbytes, topk_kept

__all__ = ["CODECS", "INT4_BLOCK", "INT8_CHUNK", "TOPK_BLOCK", "BadPayload", "decode", "encode", "encoded_nbytes",
           "sparsify"]


class BadPayload(ValueError):
    """A payload whose layout does not match its codec (the wire layer turns it into CorruptObject)."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Byte view of a tensor on the host (bf16 through an int16 view): zero-copy for a contiguous
    CPU tensor; a device tensor is copied to the host first (waiting for its stream)."""
    t = t.contiguous() if t.device.type == "cpu" else t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def _rows(x: torch.Tensor, size: int) -> torch.Tensor:
    """x zero-padded to whole blocks, as (blocks, size): a view of x (read-only use) when it is
    whole blocks already, so a shard is not copied just to be looked at in blocks."""
    x = x.float()
    if x.numel() % size == 0 and x.is_contiguous():
        return x.view(-1, size)
    return torch.nn.functional.pad(x, (0, (-x.numel()) % size)).view(-1, size)


def _absmax_scale(rows: torch.Tensor, levels: int) -> torch.Tensor:
    """A block's absmax / levels; 1 for an all-zero block. A block holding NaN or Inf keeps its
    NaN or Inf scale, so it decodes non-finite and the reducer leaves it out (a scale of 1 would
    launder a diverged replica's NaN into finite numbers). The absmax is max(max, −min): two
    reductions, no block-sized |x| made."""
    low, high = torch.aminmax(rows, dim=1)
    scale = torch.maximum(high, low.neg_()).div_(exact_divisor(levels, rows))
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def exact_divisor(value: float, like: torch.Tensor) -> torch.Tensor | float:
    """`value` as a divisor that divides exactly (one correctly rounded division) on `like`'s
    device: a Python number on the host; on a GPU a one-element tensor there, since CUDA turns a
    division by a Python number into a multiply by its reciprocal, which can differ in the last bit."""
    if like.device.type == "cpu":
        return value
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _scales(buf: memoryview, dtype: torch.dtype, count: int, device: torch.device | None = None) -> torch.Tensor:
    """A payload's block scales as fp32 on `device` (checked on the host). The encoder writes only
    positive (or, for a non-finite block, NaN/Inf) scales; zero or negative ones are another
    writer's bytes."""
    scale = torch.frombuffer(buf, dtype=dtype, count=count)
    if bool((scale <= 0).any()):
        raise BadPayload("a block scale is zero or negative (out of range)")
    return _to(scale, device).float()


def _to(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`t` (read from a payload on the host) on the device the decode runs on."""
    return t if device is None or device.type == "cpu" else t.to(device)


def encoded_nbytes(numel: int, codec: str, payload: memoryview | None = None) -> int:
    """The payload size of `numel` elements; for `topk` it depends on the support, read from `payload`."""
    if codec != "topk":
        return payload_nbytes(numel, codec)
    n_blocks = _blocks(numel, TOPK_BLOCK)
    if payload is None or payload.nbytes < 6 * n_blocks:
        return payload_nbytes(numel, codec, 0)  # the fixed part: one scale and one count per block
    counts = torch.frombuffer(payload, dtype=torch.int16, count=n_blocks, offset=4 * n_blocks)
    return payload_nbytes(numel, codec, int(counts.sum()))


def encode(x: torch.Tensor, codec: str) -> list[memoryview]:
    """fp32 vector → payload parts on the host (concatenated on the wire), computed on x's device."""
    x = x.detach().reshape(-1)
    if codec == "fp32":
        return [_as_bytes(x.float())]
    if codec == "bf16":
        return [_as_bytes(x.to(torch.bfloat16))]
    if codec == "fp16":
        return [_as_bytes(x.to(torch.float16))]
    if codec == "int8":
        rows = _rows(x, INT8_CHUNK)
        scale = _absmax_scale(rows, 127)
        q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:x.numel()]
        return [_as_bytes(scale), _as_bytes(q)]
    if codec == "int4":
        return _encode_int4(x)
    if codec == "topk":
        return _encode_sparse(x)
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


def decode(payload: memoryview | bytes, codec: str, numel: int, device: torch.device | None = None) -> torch.Tensor:
    """Payload → fp32 vector on `device` (default: the host), for read-only use: on the host an
    fp32 payload decodes to a view of it. The payload's layout is checked on the host."""
    buf = memoryview(payload)
    if codec == "fp32":  # a view: torch.frombuffer keeps the buffer alive, and callers only read it
        return _to(torch.frombuffer(buf, dtype=torch.float32, count=numel), device)
    if codec == "bf16":
        return _to(torch.frombuffer(buf, dtype=torch.int16, count=numel), device).view(torch.bfloat16).float()
    if codec == "fp16":
        return _to(torch.frombuffer(buf, dtype=torch.float16, count=numel), device).float()
    if codec == "int8":
        n_chunks = _blocks(numel, INT8_CHUNK)
        scale = _scales(buf, torch.float32, n_chunks, device)
        q = _to(torch.frombuffer(buf, dtype=torch.int8, count=numel, offset=4 * n_chunks), device).float()
        rows = _rows(q, INT8_CHUNK) * scale[:, None]
        return rows.reshape(-1)[:numel].contiguous()
    if codec == "int4":
        return _decode_int4(buf, numel, device)
    if codec == "topk":
        return _decode_sparse(buf, numel, device)
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


# -- int4 ------------------------------------------------------------------------------------
#
#   scales fp16 × blocks | values, two per byte (low nibble first), each q + 8 for q in -7..7
#
# Written to make few block-sized temporaries (in-place steps, no padded copy of a whole shard):
# the codec runs on the host beside the training loop every round, so its passes over memory are
# what an overlapped round takes from the inner steps. Each step is the same elementwise
# operation as the plain formulas, so the bytes and the decoded floats are theirs
# (test_int4_codec.py), save the scale floor below and which NaN a non-finite block's scale holds.

# The smallest positive fp16 (a subnormal). A block whose absmax / 7 is below it would get a
# scale of 0 in fp16, which no reader accepts (`_scales`); its values are then rounded at this
# scale instead, off by at most half of it.
_INT4_MIN_SCALE = 2.0 ** -24


def _encode_int4(x: torch.Tensor) -> list[memoryview]:
    n = x.numel()
    rows = _rows(x, INT4_BLOCK)
    scale = _absmax_scale(rows, 7).to(torch.float16).clamp_(min=_INT4_MIN_SCALE)  # NaN and Inf stay
    q = torch.div(rows, scale.float()[:, None])  # by the scale as the reader will see it
    q.round_().clamp_(-7, 7).add_(8)
    q = q.view(-1)[:n].to(torch.uint8)
    if n % 2:
        q = torch.cat([q, q.new_full((1,), 8)])
    pairs = q.view(-1, 2)
    packed = pairs[:, 1] << 4
    packed |= pairs[:, 0]
    return [_as_bytes(scale), _as_bytes(packed)]


def _decode_int4(buf: memoryview, numel: int, device: torch.device | None = None) -> torch.Tensor:
    n_blocks = _blocks(numel, INT4_BLOCK)
    scale = _scales(buf, torch.float16, n_blocks, device)
    packed = _to(torch.frombuffer(buf, dtype=torch.uint8, count=(numel + 1) // 2, offset=2 * n_blocks), device)
    out = torch.empty(n_blocks * INT4_BLOCK, dtype=torch.float32, device=packed.device)
    pairs = out[:2 * packed.numel()].view(-1, 2)
    pairs[:, 0].copy_(packed & 0x0F)
    pairs[:, 1].copy_(packed >> 4)
    out[2 * packed.numel():] = 8  # the last block's padding decodes to 0
    out.sub_(8).view(-1, INT4_BLOCK).mul_(scale[:, None])
    return out[:numel]


# -- topk ------------------------------------------------------------------------------------
#
#   scales fp32 × blocks | counts int16 × blocks | indices int16 × kept | values int8 × kept
#
# Indices are block-local (0..4095) and ascending within each block; blocks follow in order.


def sparsify(x: torch.Tensor, density: float) -> torch.Tensor:
    """x with all but the `density` largest-magnitude elements of each 4,096-element block zeroed.

    A new tensor; `x` is not changed. Ties break toward the lower index (torch.topk on CPU is
    deterministic), so the same x gives the same support everywhere.
    """
    n = x.numel()
    k = topk_kept(density)
    if k >= TOPK_BLOCK:
        return x.clone()
    rows = _rows(x, TOPK_BLOCK)
    magnitude = rows.abs()
    tail = n % TOPK_BLOCK
    if tail:
        magnitude[-1, tail:] = -1.0  # padding is never chosen over a real element
    kept = torch.zeros_like(rows)
    idx = magnitude.topk(k, dim=1, sorted=False).indices
    kept.scatter_(1, idx, rows.gather(1, idx))
    return kept.reshape(-1)[:n].contiguous()


def _encode_sparse(x: torch.Tensor) -> list[memoryview]:
    """The nonzero elements of x, block by block, values int8 with an absmax scale per block."""
    rows = _rows(x, TOPK_BLOCK)
    nonzero = rows != 0
    counts = nonzero.sum(dim=1).to(torch.int16)
    scale = _absmax_scale(rows, 127)
    where = nonzero.nonzero()  # (block, index) pairs, row-major: ascending within each block
    values = rows[where[:, 0], where[:, 1]]
    q = torch.round(values / scale[where[:, 0]]).clamp_(-127, 127).to(torch.int8)
    return [_as_bytes(scale), _as_bytes(counts), _as_bytes(where[:, 1].to(torch.int16)), _as_bytes(q)]


def _decode_sparse(buf: memoryview, numel: int, device: torch.device | None = None) -> torch.Tensor:
    blocks = _blocks(numel, TOPK_BLOCK)
    if buf.nbytes < 6 * blocks:
        raise BadPayload("shorter than its block table")
    scale = _scales(buf, torch.float32, blocks)
    counts = torch.frombuffer(buf, dtype=torch.int16, count=blocks, offset=4 * blocks).long()
    kept = int(counts.sum())
    if (counts < 0).any() or (counts > TOPK_BLOCK).any() or buf.nbytes != 6 * blocks + 3 * kept:
        raise BadPayload("block counts do not match the payload")
    out = torch.zeros(blocks * TOPK_BLOCK, dtype=torch.float32)
    if kept:
        local = torch.frombuffer(buf, dtype=torch.int16, count=kept, offset=6 * blocks).long()
        q = torch.frombuffer(buf, dtype=torch.int8, count=kept, offset=6 * blocks + 2 * kept).float()
        block = torch.repeat_interleave(torch.arange(blocks), counts)
        if (local < 0).any() or (local >= TOPK_BLOCK).any():
            raise BadPayload("an index lies outside its block")
        out[block * TOPK_BLOCK + local] = q * scale[block]
    return _to(out[:numel].contiguous(), device)  # sparse: decoded on the host, then moved
