"""What a benchmark or a simulation replays, and how it is summed up.

``traces`` (readers, windows, scaling; packaged excerpts; ``download``:
``carpool traces download``), ``arrivals`` (trace, Poisson, gamma, surges),
``prompts``, ``spec`` (the typed ``WorkloadSpec`` and the planned
requests), ``stats`` (request records, summaries, goodput; SLO checks come
from ``carpool.slo``), ``results`` (the bench-serve result document) and
``command`` (the workload flags, built into a spec in one place).

Below both ``carpool.bench`` and ``carpool.sim``; plain Python, no torch.
"""
