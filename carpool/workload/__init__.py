"""What a benchmark or a simulation replays: public request traces (readers,
windows, scaling; packaged excerpts and ``carpool traces download``).

Below both ``carpool.bench`` and ``carpool.sim``; plain Python, no torch.
"""
