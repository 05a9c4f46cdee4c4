"""How many workers one request may be sent to when its worker dies.

A fleet (live: ``carpool.fleet.local``, Ray Serve's ingress; simulated:
``carpool.sim.failures``) sends a request whose worker died to another:
as it was, when nothing of it reached the client, else resumed after the
tokens that did. After ``MAX_ATTEMPTS`` workers it fails instead: a
request that kills its workers (or a fleet dying around it) must end.
"""
from __future__ import annotations

MAX_ATTEMPTS = 3
