"""The live KV connector's two sides (vLLM v1's split): the scheduler side
turns the KV manager's calls into orders and never holds the scheduler,
the cache tensors or the model; the worker side moves the bytes those
orders name and reports finished fetches by load id; a fetch whose
request left is dropped, never written into blocks that are no longer its."""
from __future__ import annotations

import torch

from carpool.kv_transfer.blocks import KVBlockIO
from carpool.kv_transfer.connector import StoreConnector
from carpool.kv_transfer.stores import MemoryStore
from carpool.scheduler import Request, Scheduler
from carpool.scheduler.kv_connector import KVConnectorMeta

PRINT = bytes(range(16))


def _caches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, 4, 4, generator=generator).to(torch.bfloat16),
             torch.randn(2, 8, 4, 4, generator=generator).to(torch.bfloat16)) for _ in range(2)]


def _request(name: str, tokens: int = 13) -> Request:
    return Request(name, list(range(tokens)), 1, 0.0)


def _settled(worker) -> list[tuple[int, int]]:  # noqa: ANN001
    worker.flush()
    return worker.fetched()


def test_saves_and_loads_travel_as_orders_between_the_two_sides():
    store = MemoryStore(1 << 20)
    source = StoreConnector(store, KVBlockIO(_caches(0)), PRINT)
    request = _request("a")
    source.scheduler.save(request, [11, 22, 33], 0, [5, 1, 6])
    meta = source.scheduler.take_meta()
    assert [(o.hashes, o.block_ids, o.export) for o in meta.saves] == [
        ((11, 22, 33), (5, 1, 6), False)]
    assert not source.scheduler.take_meta()  # handed over once
    source.worker.start(meta)
    source.flush()
    assert source.stats.blocks_saved == 3 and len(store) == 3
    # Another replica: the lookup, then a load into the blocks its KV manager gave.
    target = StoreConnector(store, KVBlockIO(_caches(1)), PRINT)
    wanted = _request("b")
    assert target.scheduler.loadable(wanted, [11, 22, 33, 44]) == 3
    target.scheduler.load(wanted, [11, 22, 33], 0, [2, 3, 4])
    target.worker.start(target.scheduler.take_meta())
    (done,) = target.scheduler.resolve(_settled(target.worker))
    assert done[1:] == (wanted, 3 * source.worker.layout.block_size)
    target.worker.write([done[0]])
    for (k, v), (k2, v2) in zip(source.worker.io.kv_caches, target.worker.io.kv_caches):
        for src, dst in ((5, 2), (1, 3), (6, 4)):
            assert torch.equal(k[:, src], k2[:, dst]) and torch.equal(v[:, src], v2[:, dst])
    assert target.stats.blocks_loaded == 3
    # Neither side reaches into a scheduler.
    for side in (source.scheduler, source.worker):
        assert not any(isinstance(value, Scheduler) for value in vars(side).values())


def test_a_load_whose_request_left_is_never_written():
    store = MemoryStore(1 << 20)
    source = StoreConnector(store, KVBlockIO(_caches(0)), PRINT)
    source.scheduler.save(_request("a"), [7], 0, [0])
    source.worker.start(source.scheduler.take_meta())
    source.flush()
    target = StoreConnector(store, KVBlockIO(_caches(1)), PRINT)
    before = [k.clone() for k, _ in target.worker.io.kv_caches]
    target.scheduler.load(_request("gone"), [7], 0, [3])
    target.worker.start(target.scheduler.take_meta())
    fetched = _settled(target.worker)
    assert [blocks for _, blocks in fetched] == [1]
    target.scheduler.resolve(fetched)
    target.worker.write([])  # its request was aborted meanwhile: keep none
    assert all(torch.equal(k, b) for (k, _), b in zip(target.worker.io.kv_caches, before))
    assert target.stats.blocks_loaded == 0 and target.worker.fetched() == []


def test_an_exporting_requests_streamed_blocks_are_not_sent_again():
    store = MemoryStore(1 << 20)
    connector = StoreConnector(store, KVBlockIO(_caches(0)), PRINT, model=object())
    request = _request("p")
    request.kv_export = True
    connector.scheduler.filling(request, 0, [4, 5], [1, 2])
    assert connector.scheduler.take_meta().streamed == [(4, 1), (5, 2)]
    connector.scheduler.save(request, [1, 2, 3], 0, [4, 5, 6])  # block 2 came from the cache
    meta = connector.scheduler.take_meta()
    assert [(o.hashes, o.block_ids, o.export) for o in meta.saves] == [((3,), (6,), True)]
    assert connector.scheduler.streamed == {}
    connector.scheduler.filling(request, 3, [7], [9])
    connector.scheduler.forget(request)  # aborted before its save
    assert connector.scheduler.streamed == {}
    # A worker side that cannot hook the model streams nothing: blocks go whole.
    whole = StoreConnector(store, KVBlockIO(_caches(0)), PRINT)
    whole.scheduler.filling(request, 0, [4], [1])
    assert whole.scheduler.take_meta() == KVConnectorMeta()
    connector.close()
    whole.close()
