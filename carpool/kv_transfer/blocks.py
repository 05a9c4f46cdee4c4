"""The worker side's bytes: KV blocks read out of and written into a
replica's cache tensors (``TorchExecutor.kv_caches``), as payload data.

A block's data (``payload.BlockLayout``) is, layer after layer, its K block
then its V block exactly as the cache holds them (K transposed: heads x
head_dim x block_size; V: heads x block_size x head_dim), so a read and a
write are one gather / scatter per layer and tensor, and a block written
back holds bit for bit what was read.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from carpool.kv_transfer.payload import BlockLayout

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class KVBlockIO:
    """Gathers and scatters whole blocks of ``kv_caches`` (a list of
    (K, V) per layer, K shaped (heads, blocks, head_dim, block_size) and V
    (heads, blocks, block_size, head_dim); or, for a latent cache (MLA),
    one tensor in V's layout given as both, ``K is V``)."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not kv_caches:
            raise ValueError("a KV cache has at least one layer")
        k, v = kv_caches[0]
        self.latent = k is v
        if self.latent:
            heads, _, size, dim = v.shape
        else:
            heads, _, dim, size = k.shape
        if tuple(v.shape) != (heads, k.shape[1], size, dim) or k.dtype not in _DTYPE_NAMES:
            raise ValueError(f"unexpected KV cache layout: K {tuple(k.shape)}, V "
                             f"{tuple(v.shape)}, {k.dtype}")
        self.kv_caches = kv_caches
        self.layout = BlockLayout(len(kv_caches), heads, dim, size, _DTYPE_NAMES[k.dtype],
                                  tensors=1 if self.latent else 2)
        self.device = k.device
        self.dtype = k.dtype

    def _tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        k, v = self.kv_caches[layer]
        return (v,) if self.latent else (k, v)

    def gather(self, block_ids: Sequence[int], layers: Sequence[int] | None = None,
               ) -> torch.Tensor:
        """The blocks' data as bytes on the host, shaped [blocks, layers,
        tensors, heads, one head's bytes] (``layers``: these, in order; None:
        every one): a head's slice of a tensor's block is contiguous, so a
        tensor-parallel rank's heads are one slice of this
        (``carpool.parallel.kv_slices``)."""
        layers = range(self.layout.num_layers) if layers is None else layers
        count, heads = len(block_ids), self.layout.num_kv_heads
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        parts = [cache.index_select(1, ids).transpose(0, 1).reshape(count, heads, -1)
                 for layer in layers for cache in self._tensors(layer)]
        out = torch.stack(parts, dim=1).cpu()
        return out.view(torch.uint8).view(count, len(layers), self.layout.tensors, heads, -1)

    def empty(self, count: int) -> torch.Tensor:
        """An uninitialised host tensor of ``gather``'s shape for ``count`` whole blocks."""
        layout = self.layout
        return torch.empty((count, layout.num_layers, layout.tensors, layout.num_kv_heads,
                            layout.layer_bytes // layout.num_kv_heads), dtype=torch.uint8)

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Put ``data`` (``gather``'s shape and bytes, every layer) into the blocks."""
        count, layout = len(block_ids), self.layout
        src = data.contiguous().view(self.dtype).to(self.device)
        src = src.view(count, layout.num_layers, layout.tensors, -1)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer in range(layout.num_layers):
            for index, cache in enumerate(self._tensors(layer)):
                block_shape = (count, *cache.shape[:1], *cache.shape[2:])
                cache.index_copy_(1, ids, src[:, layer, index].reshape(block_shape)
                                  .transpose(0, 1))

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block's data, in order (a copy: the blocks may change after)."""
        return block_bytes(self.gather(block_ids)) if block_ids else []

    def read_layer(self, block_ids: Sequence[int], layer: int) -> list[bytes]:
        """Each block's data of one layer (its K block then its V block, or
        its latent block): the part of ``read``'s data for that layer, so the
        parts of every layer joined in order are the block's data."""
        return block_bytes(self.gather(block_ids, [layer])) if block_ids else []

    def write(self, block_ids: Sequence[int], datas: Sequence[bytes | memoryview]) -> None:
        """Put each data into its block (``len(datas) == len(block_ids)``)."""
        if not block_ids:
            if datas:
                raise ValueError("one data per block")
            return
        self.scatter(block_ids, joined_blocks(datas, len(block_ids), self.layout))


def joined_blocks(datas: Sequence[bytes | memoryview], count: int,
                  layout: BlockLayout) -> torch.Tensor:
    """``count`` blocks' datas of ``layout`` as one byte tensor, checked."""
    if len(datas) != count:
        raise ValueError("one data per block")
    joined = bytearray().join(datas)
    if len(joined) != count * layout.data_bytes:
        raise ValueError(f"{count} blocks of this layout are {count * layout.data_bytes} "
                         f"bytes, got {len(joined)}")
    return torch.frombuffer(joined, dtype=torch.uint8).view(
        count, layout.num_layers, layout.tensors, layout.num_kv_heads, -1)


def block_bytes(data: torch.Tensor) -> list[bytes]:
    raw = data.reshape(data.shape[0], -1).numpy()
    return [raw[i].tobytes() for i in range(raw.shape[0])]


def weights_fingerprint(model: torch.nn.Module, description: str,
                        dtype: torch.dtype | None = None) -> bytes:
    """``payload.model_fingerprint`` of a loaded model: its description
    and, per weight (by its name in the plain model), its shape and first 64
    values' bytes (as ``dtype``, where given: the model is not yet in the
    dtype it runs in). Layout-only changes (packed, blocked or quantized
    decode copies) keep the fingerprint: they compute the same KV."""
    from carpool.kv_transfer.payload import model_fingerprint

    samples = bytearray()
    for name, tensor in sorted(_plain_weights(model).items()):
        head = tensor.detach().flatten()[:64].cpu().to(dtype or tensor.dtype).contiguous()
        samples += f"{name}{tuple(tensor.shape)}{head.dtype}".encode()
        samples += head.view(torch.uint8).numpy().tobytes() if head.numel() else b""
    return model_fingerprint(description, bytes(samples))


def _plain_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights by their plain names: a layer's ``dense`` path
    (carpool/model/blocked_linear.py) counts as the layer, and a blocked
    weight (opaque to everything but a matrix product) is read back dense.
    ``head`` (the LM head's decode copy, when there is one) is left out: its
    weight is the embedding table's or ``lm_head``'s, counted there."""
    found: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("head."):
            found.setdefault(name.replace(".dense.", "."), tensor)
    for name, module in model.named_modules():
        plain_experts = getattr(module, "plain_expert_weights", None)
        if plain_experts is not None and getattr(module, "cpu_experts", None) is not None:
            for param, tensor in plain_experts().items():
                found[f"{name}.{param}"] = tensor
        blocked = getattr(module, "blocked", None)
        if isinstance(blocked, torch.Tensor) and name != "head" and not name.startswith("head."):
            found.setdefault(name.removesuffix(".dense") + ".weight", blocked.to_dense())
    return found
