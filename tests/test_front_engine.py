"""Every front engine implements ``FrontEngine`` (carpool/engine/front.py):
each member, with the same kind (property or attribute, plain or async
method) and a signature that takes the protocol's calls; and the
``add_request`` prologue they share behaves as written."""
from __future__ import annotations

import inspect

import pytest

from carpool.engine.async_engine import AsyncEngine
from carpool.engine.client import EngineClient
from carpool.engine.front import FrontEngine, RequestIntake
from carpool.engine.streams import EngineDeadError
from carpool.fleet.local import FleetEngine
from carpool.fleet.pd import PDFleet
from carpool.sampling_params import SamplingParams

FRONTS = [AsyncEngine, EngineClient, FleetEngine, PDFleet]
try:  # Ray is an optional extra
    from carpool.ray_serve.engine import RayEngine

    FRONTS.append(RayEngine)
except ImportError:  # pragma: no cover - the test extra installs Ray
    pass

ATTRIBUTES = sorted(FrontEngine.__annotations__)
MEMBERS = sorted(name for name, value in vars(FrontEngine).items()
                 if not name.startswith("_") and (callable(value) or isinstance(value, property)))


def _sets_in_init(cls: type, name: str) -> bool:
    inits = [inspect.getsource(vars(klass)["__init__"]) for klass in cls.__mro__
             if inspect.isfunction(vars(klass).get("__init__"))]
    return any(f"self.{name} =" in source or f"self.{name}:" in source for source in inits)


def _takes(impl, proto) -> str | None:  # noqa: ANN001
    """Why ``impl`` cannot be called as ``proto`` is (None: it can)."""
    if inspect.iscoroutinefunction(impl) != inspect.iscoroutinefunction(proto):
        return "async differs"
    have = inspect.signature(impl).parameters
    want = inspect.signature(proto).parameters
    for name, param in want.items():
        if name not in have:
            return f"no parameter {name}"
        if (param.default is inspect.Parameter.empty) != \
                (have[name].default is inspect.Parameter.empty):
            return f"{name}'s default differs"
    extra = [n for n, p in have.items() if n not in want and p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"required extra parameters {extra}" if extra else None


@pytest.mark.parametrize("front", FRONTS, ids=lambda cls: cls.__name__)
def test_each_front_implements_the_whole_interface(front):
    problems = []
    for name in ATTRIBUTES:
        if not (_sets_in_init(front, name) or hasattr(front, name)):
            problems.append(f"attribute {name} missing")
    for name in MEMBERS:
        proto = inspect.getattr_static(FrontEngine, name)
        impl = inspect.getattr_static(front, name, None)
        if isinstance(proto, property):  # a property, or an attribute set in __init__
            if not isinstance(impl, property) and not _sets_in_init(front, name):
                problems.append(f"{name} is neither a property nor set in __init__")
        elif impl is None or not callable(impl):
            problems.append(f"method {name} missing")
        elif (why := _takes(impl, proto)) is not None:
            problems.append(f"{name}: {why}")
    assert not problems, problems


class _Words:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


class _Front(RequestIntake):
    def __init__(self) -> None:
        self.tokenizer = _Words()


def test_the_shared_prologue_names_tokenizes_and_refuses():
    front = _Front()
    assert front._intake("a bb ccc", None, None, ()) == ("req-1", [1, 2, 3], SamplingParams())
    params = SamplingParams(max_tokens=3)
    assert front._intake([7, 8], params, "mine", ()) == ("mine", [7, 8], params)
    assert front._intake([1], None, None, ())[0] == "req-2"
    with pytest.raises(ValueError, match="duplicate request id 'mine'"):
        front._intake([1], None, "mine", {"mine"})
    front._stopping = True
    with pytest.raises(EngineDeadError, match="shut down"):
        front._intake([1], None, None, ())
    front.error = RuntimeError("boom")
    with pytest.raises(EngineDeadError, match="boom"):
        front._intake([1], None, None, ())
