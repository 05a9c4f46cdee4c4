"""The live fleet: engine worker processes behind carpool's router on one
machine (``local``), prefill/decode pools with KV moving between them
(``pd``), and the shared KV store they use (``store_host``).

A floor between ``engine/`` (one replica) and ``server/`` (HTTP): a fleet is
a front engine the server drives like a single one, and ``ray_serve/``
builds its own fleet from the same pieces. Nothing here speaks HTTP.
"""
