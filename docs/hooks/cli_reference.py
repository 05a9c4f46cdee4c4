"""mkdocs hook: the CLI reference page (``reference/cli.md``), generated from
carpool's argparse parsers by ``scripts/cli_reference.py`` on every build.

``docs/reference/cli.md`` on disk is a stand-in (it says how to get the
page without the site, and keeps links to it working when the Markdown is
read directly); the hook replaces it with the generated page, so the site's
page is always built from the code and never stale.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/cli.md"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "carpool_cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    stand_in = files.get_file_from_path(PAGE)
    if stand_in is not None:
        files.remove(stand_in)
    files.append(File.generated(config, PAGE, content=_generator().render()))
    return files
