"""Flag value parsers, and required flags, for the commands' flag tables
(``carpool.settings_fields``)."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` with its ValueError shown by argparse word for word."""
    def parsed(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parsed.__name__ = parse.__name__
    return parsed
