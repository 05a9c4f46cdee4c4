"""carpool on Ray Serve: thin adapters, the decisions stay in ``carpool.cluster``.

``carpool.ray_serve.app:build_app`` builds the application (``serve run``,
a RayService, ``carpool serve --backend ray``): an ingress deployment
running carpool's FastAPI app and an engine deployment whose replicas each
hold one in-process ``AsyncEngine``; tokens stream back through deployment
handles. carpool's router picks the engine replica (a Ray Serve request
router, ``router.py``) and carpool's autoscaler sizes the engine deployment
(a Ray Serve autoscaling policy, ``autoscaling.py``).

Nothing carpool's own crosses a process boundary pickled: handles carry
msgspec bytes of the structs in ``wire.py`` (and ``carpool.engine.wire``)
and plain strings. Ray is an optional extra (``pip install -e '.[ray]'``);
only this package imports it.
"""
