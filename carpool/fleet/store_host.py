"""The KV store a front process hosts for its replicas (``kv_store: local``
or ``shm``): a TCP store, or a shared-memory arena, on 127.0.0.1."""
from __future__ import annotations

import logging

from carpool.config import EngineConfig, parse_size

log = logging.getLogger("carpool.server")


def local_kv_store(config: EngineConfig):
    """``kv_store: local`` (or ``shm``): a TCP (or shared-memory) store
    served by this front process on 127.0.0.1 for its replicas (``config``
    is pointed at it); else None."""
    cache = config.cache
    if cache.kv_store == "shm":
        from carpool.kv_transfer.shm_store import ShmStoreServer

        server = ShmStoreServer(parse_size(cache.kv_store_capacity), cache.kv_store_ttl).start()
        cache.kv_store = server.url
        log.info("shared-memory KV store for the replicas: %s (%s)", cache.kv_store,
                 cache.kv_store_capacity)
        return server
    if cache.kv_store != "local":
        return None
    from carpool.kv_transfer.stores import MemoryStore
    from carpool.kv_transfer.tcp_store import TcpStoreServer

    server = TcpStoreServer(MemoryStore(parse_size(cache.kv_store_capacity),
                                        cache.kv_store_ttl)).start()
    cache.kv_store = "tcp://%s:%d" % server.address
    log.info("shared KV store for the replicas: %s (%s)", cache.kv_store,
             cache.kv_store_capacity)
    return server
