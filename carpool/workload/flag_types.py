"""Flag value parsers, and required flags, for the commands' flag tables
(``carpool.settings_fields``)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` with its ValueError shown by argparse word for word."""
    def parsed(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parsed.__name__ = parse.__name__
    return parsed


class RequiredFlags:
    """An argparse parser or group whose flags named in ``dests`` are
    required: ``add_setting_args(RequiredFlags(group, "slo"), Flags)``
    (a ``setting`` has no ``required`` of its own)."""

    def __init__(self, group: Any, *dests: str) -> None:
        self._group = group
        self._dests = set(dests)

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        if kwargs.get("dest") in self._dests:
            kwargs["required"] = True
        return self._group.add_argument(*names, **kwargs)
