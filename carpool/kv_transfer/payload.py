"""The bytes of one KV block as it leaves a replica: an explicit, checked format.

A block that moves between replicas (P/D handoff) or into a shared store is
read back by a process that may run another model, another dtype or
another cache layout. Computing with such a block would give garbage
silently, so every payload carries what its reader must match and the
reader refuses on any difference (``KVPayloadError``, with the reason):

    header (little-endian, 64 bytes, ``_HEADER``):
      magic  b"CPKV", format version (u16), dtype code (u8),
      layout code (u8: 0 K and V per layer, 1 one latent per layer: MLA)
      block key (u64: the fleet's chained block hash)
      model fingerprint (16 bytes: ``model_fingerprint``)
      num_layers, num_kv_heads, head_dim, block_size (u16 each)
      data length (u64), CRC-32 of the data (u32), reserved (u32)
    data: for each layer, its K block then its V block, as the cache holds
      them (``BlockLayout``: K transposed, heads x head_dim x block_size;
      V heads x block_size x head_dim), raw elements; a latent layout
      (``tensors`` 1) holds one block per layer, in V's layout.

Plain Python (struct, zlib, hashlib): no torch, no pickle.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"CPKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBBQ16sHHHHQII")
HEADER_BYTES = _HEADER.size  # 64

# Element types a block may hold, by code; the size of one element.
DTYPES = {1: ("float32", 4), 2: ("bfloat16", 2), 3: ("float16", 2)}
_DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}


class KVPayloadError(ValueError):
    """A payload this reader must not use: damaged, or made by another
    model, dtype or layout (the message says which)."""


@dataclass(frozen=True)
class BlockLayout:
    """What a block's data is: its reader's cache must be the same."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # float32 | bfloat16 | float16
    tensors: int = 2  # per layer: K and V, or 1 (MLA's latent)

    def __post_init__(self) -> None:
        if self.tensors not in (1, 2):
            raise ValueError(f"a KV block holds 1 or 2 tensors per layer, got {self.tensors}")
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"a KV block's dtype must be one of {sorted(_DTYPE_CODES)}, "
                             f"got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if not 1 <= getattr(self, name) < 1 << 16:
                raise ValueError(f"{name} must be in [1, 65536)")

    @property
    def element_bytes(self) -> int:
        return DTYPES[_DTYPE_CODES[self.dtype]][1]

    @property
    def layer_bytes(self) -> int:
        """One layer's K (or V) block, in bytes."""
        return self.num_kv_heads * self.head_dim * self.block_size * self.element_bytes

    @property
    def data_bytes(self) -> int:
        """A whole block's data: K and V (or the latent) of every layer."""
        return self.tensors * self.num_layers * self.layer_bytes


def model_fingerprint(description: str, weight_samples: bytes = b"") -> bytes:
    """16 bytes naming a model exactly enough that blocks of another never
    pass for its own: a hash of its description (architecture, shapes,
    rotary settings) and of samples of its weights (so a fine-tune of the
    same shape differs)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(description.encode())
    digest.update(weight_samples)
    return digest.digest()


def encode_block(key: int, fingerprint: bytes, layout: BlockLayout, data: bytes) -> bytes:
    """A block's payload: the header, then ``data`` (``layout.data_bytes``)."""
    if len(fingerprint) != 16:
        raise ValueError("a model fingerprint is 16 bytes")
    if len(data) != layout.data_bytes:
        raise ValueError(f"a block of this layout holds {layout.data_bytes} bytes, "
                         f"got {len(data)}")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, _DTYPE_CODES[layout.dtype], 2 - layout.tensors,
                          key & (1 << 64) - 1, fingerprint, layout.num_layers,
                          layout.num_kv_heads, layout.head_dim, layout.block_size, len(data),
                          zlib.crc32(data), 0)
    return header + data


def decode_block(payload: bytes | memoryview, key: int, fingerprint: bytes,
                 layout: BlockLayout) -> memoryview:
    """The data of ``payload`` if it is block ``key`` of this model in this
    layout, intact; else ``KVPayloadError`` naming the first difference."""
    view = memoryview(payload)
    if len(view) < HEADER_BYTES:
        raise KVPayloadError(f"a KV payload is at least {HEADER_BYTES} bytes, got {len(view)}")
    (magic, version, dtype_code, layout_code, got_key, got_print, layers, heads, dim, size,
     length, crc, _) = _HEADER.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise KVPayloadError(f"not a carpool KV block of format {FORMAT_VERSION} "
                             f"(magic {magic!r}, version {version})")
    if got_key != key & (1 << 64) - 1:
        raise KVPayloadError(f"the payload holds block {got_key:#x}, not {key:#x}")
    if got_print != fingerprint:
        raise KVPayloadError("the block was computed by another model (fingerprints differ)")
    dtype = DTYPES.get(dtype_code, ("unknown",))[0]
    theirs = (layers, heads, dim, size, dtype, 2 - layout_code)
    ours = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
            layout.dtype, layout.tensors)
    if theirs != ours:
        raise KVPayloadError(f"the block's layout (layers, kv heads, head dim, block size, "
                             f"dtype, tensors per layer) {theirs} is not this cache's {ours}")
    data = view[HEADER_BYTES:]
    if len(data) != length or length != layout.data_bytes:
        raise KVPayloadError(f"the block's data is {len(data)} bytes, expected {length} "
                             f"({layout.data_bytes} for this layout)")
    if zlib.crc32(data) != crc:
        raise KVPayloadError("the block's data is damaged (CRC-32 differs)")
    return data


def block_key_bytes(namespace: bytes, key: int) -> bytes:
    """A store's key for block ``key`` of a namespace (the model's
    fingerprint, so two models never share keys in one store)."""
    return namespace + (key & (1 << 64) - 1).to_bytes(8, "little")
