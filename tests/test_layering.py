"""The import contracts in pyproject.toml hold for carpool, and the checker
really fails on a violation (a contract that cannot fail checks nothing)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def _lint(config: Path, cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = f"{path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([LINT, "--no-cache", "--config", str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_carpool_keeps_its_import_contracts():
    result = _lint(ROOT / "pyproject.toml", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and "0 broken" in result.stdout


def test_a_cycle_or_a_forbidden_import_breaks_the_contracts(tmp_path):
    package = tmp_path / "src" / "layered"
    (package / "scheduler").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scheduler" / "__init__.py").write_text("")
    (package / "model.py").write_text("")
    (package / "a.py").write_text("from layered import b\n")
    (package / "b.py").write_text("from layered import a\n")  # a <-> b
    (package / "scheduler" / "core.py").write_text("import layered.model\n")
    config = tmp_path / "contracts.toml"
    config.write_text("""
[tool.importlinter]
root_package = "layered"

[[tool.importlinter.contracts]]
name = "scheduler is pure"
type = "forbidden"
source_modules = ["layered.scheduler"]
forbidden_modules = ["layered.model"]

[[tool.importlinter.contracts]]
name = "no cycles"
type = "acyclic_siblings"
ancestors = ["layered"]
""")
    result = _lint(config, tmp_path, tmp_path / "src")
    assert result.returncode != 0
    assert "scheduler is pure BROKEN" in result.stdout and "no cycles BROKEN" in result.stdout
    (package / "b.py").write_text("")
    (package / "scheduler" / "core.py").write_text("")
    assert _lint(config, tmp_path, tmp_path / "src").returncode == 0
