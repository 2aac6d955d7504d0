"""The tensor wire format: a small JSON header and raw bytes, checksummed, never pickle.

    b"DLCO" | version (1 byte) | header length (u32 LE) | header CRC-32 (u32 LE) | header JSON | payload

The header names what the object is (run, round, kind, owner, source), how the payload is
encoded (codec, element count) and the payload's length and CRC-32; the header has a CRC-32 of
its own, so a flipped bit anywhere in the object is caught. `unpack` checks all of it against
what the reader expected, so a truncated, corrupted, malformed or foreign object (another run,
another round, another shard — e.g. from a reused rendezvous URI) raises `CorruptObject` (never
KeyError or TypeError) and is never averaged in.

Codecs turn an fp32 vector into transport bytes and back into fp32 (accumulation is always
fp32): fp32 (4 B/elem), bf16 and fp16 (2 B/elem), int8 (1 B/elem + one fp32 scale per
INT8_CHUNK elements, symmetric absmax scaling per chunk).
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"DLCO"
VERSION = 2
INT8_CHUNK = 2048
_PREFIX = struct.Struct("<4sBII")
CODECS = ("fp32", "bf16", "fp16", "int8")
# Decoding reads straight from the downloaded (read-only) buffer and always copies out; torch's
# warning about non-writable buffers does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class CorruptObject(Exception):
    """An object failed verification: wrong magic, length, checksum, or identity."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (bf16 through an int16 view)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def encoded_nbytes(numel: int, codec: str) -> int:
    if codec == "fp32":
        return 4 * numel
    if codec in ("bf16", "fp16"):
        return 2 * numel
    if codec == "int8":
        return numel + 4 * ((numel + INT8_CHUNK - 1) // INT8_CHUNK)
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


def encode_tensor(x: torch.Tensor, codec: str) -> list[memoryview]:
    """fp32 CPU vector → payload parts (concatenated on the wire)."""
    x = x.detach().reshape(-1)
    if codec == "fp32":
        return [_as_bytes(x.float())]
    if codec == "bf16":
        return [_as_bytes(x.to(torch.bfloat16))]
    if codec == "fp16":
        return [_as_bytes(x.to(torch.float16))]
    if codec == "int8":
        n = x.numel()
        pad = (-n) % INT8_CHUNK
        rows = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, INT8_CHUNK)
        scale = rows.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return [_as_bytes(scale), _as_bytes(q)]
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


def decode_tensor(payload: memoryview | bytes, codec: str, numel: int) -> torch.Tensor:
    """Payload → fp32 vector (read-only use: for fp32 it is a view of the payload)."""
    buf = memoryview(payload)
    if codec == "fp32":  # a view: torch.frombuffer keeps the buffer alive, and callers only read it
        return torch.frombuffer(buf, dtype=torch.float32, count=numel)
    if codec == "bf16":
        return torch.frombuffer(buf, dtype=torch.int16, count=numel).view(torch.bfloat16).float()
    if codec == "fp16":
        return torch.frombuffer(buf, dtype=torch.float16, count=numel).float()
    if codec == "int8":
        n_chunks = (numel + INT8_CHUNK - 1) // INT8_CHUNK
        scale = torch.frombuffer(buf, dtype=torch.float32, count=n_chunks)
        q = torch.frombuffer(buf, dtype=torch.int8, count=numel, offset=4 * n_chunks).float()
        pad = (-numel) % INT8_CHUNK
        rows = torch.nn.functional.pad(q, (0, pad)).view(-1, INT8_CHUNK) * scale[:, None]
        return rows.reshape(-1)[:numel].contiguous()
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


@dataclass(frozen=True)
class Identity:
    """Who an object claims to be; the reader states what it expects."""

    run: str
    round: int
    kind: str
    owner: int = -1
    src: int = -1


def pack(identity: Identity, parts: list[memoryview], *, codec: str, numel: int,
         meta: dict[str, Any] | None = None) -> list[bytes | memoryview]:
    """The object as a list of buffers (header first); the store writes them without joining."""
    crc = 0
    nbytes = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
        nbytes += part.nbytes
    header = json.dumps({"run": identity.run, "round": identity.round, "kind": identity.kind,
                         "owner": identity.owner, "src": identity.src, "codec": codec, "numel": numel,
                         "nbytes": nbytes, "crc32": crc, "meta": meta or {}}, separators=(",", ":")).encode()
    return [_PREFIX.pack(MAGIC, VERSION, len(header), zlib.crc32(header)) + header, *parts]


def joined(blob: list[bytes | memoryview]) -> bytes:
    """A packed object as one bytes value (tests, small objects)."""
    return b"".join(blob)


@dataclass
class Unpacked:
    header: dict[str, Any]
    payload: memoryview

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.get("meta", {})

    def tensor(self) -> torch.Tensor:
        return decode_tensor(self.payload, self.header["codec"], self.header["numel"])


def unpack(blob: bytes | memoryview, expect: Identity, key: str) -> Unpacked:
    """Verify and split an object. Raises CorruptObject naming the key and what is wrong."""
    view = memoryview(blob)
    if view.nbytes < _PREFIX.size:
        raise CorruptObject(f"{key}: truncated ({view.nbytes} bytes, no header)")
    magic, version, hlen, hcrc = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"{key}: not a diloco object (magic {bytes(magic)!r}, version {version})")
    end = _PREFIX.size + hlen
    if view.nbytes < end:
        raise CorruptObject(f"{key}: truncated inside its header")
    raw_header = view[_PREFIX.size:end]
    if zlib.crc32(raw_header) != hcrc:
        raise CorruptObject(f"{key}: header checksum mismatch: the header is corrupt")
    try:
        header = json.loads(bytes(raw_header))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptObject(f"{key}: unreadable header ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("numel"), int) or not isinstance(header.get("meta", {}), dict):
        raise CorruptObject(f"{key}: malformed header")
    payload = view[end:]
    if payload.nbytes != header.get("nbytes"):
        raise CorruptObject(f"{key}: truncated or padded payload ({payload.nbytes} bytes, "
                            f"header says {header.get('nbytes')})")
    if zlib.crc32(payload) != header.get("crc32"):
        raise CorruptObject(f"{key}: checksum mismatch: the payload is corrupt")
    got = (header.get("run"), header.get("round"), header.get("kind"), header.get("owner"), header.get("src"))
    want = (expect.run, expect.round, expect.kind, expect.owner, expect.src)
    if got != want:
        raise CorruptObject(f"{key}: foreign object: it is (run, round, kind, owner, src)={got}, expected {want}")
    if header.get("codec") not in CODECS or encoded_nbytes(header["numel"], header["codec"]) != payload.nbytes:
        raise CorruptObject(f"{key}: payload size does not match codec {header.get('codec')!r}")
    return Unpacked(header, payload)


def pack_json(identity: Identity, meta: dict[str, Any]) -> bytes:
    """A small checksummed record (no payload), e.g. a round's membership."""
    return joined(pack(identity, [], codec="fp32", numel=0, meta=meta))
