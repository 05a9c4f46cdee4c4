"""Measurements that drive the real engine for the simulator's sake: the
step-cost model of this machine (``carpool measure``) and the simulator's
fidelity against the real engine (``carpool fidelity``). Above ``sim`` and
``bench``, whose code they combine."""
