"""Fetching the whole traces from their public repositories.

Each trace comes from a pinned commit of the repository that published it,
is checked against its sha256 before it replaces anything, and lands under
``<cache>/traces/`` in the layout `TRACE_FILES` names (the first place
`resolve_trace` looks after ``$CARPOOL_TRACES``). The licence texts, packaged
with the excerpts, are copied beside the files.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import httpx
from tqdm import tqdm

from carpool.workload.traces import EXCERPTS_DIR, TRACE_FILES

DEFAULT_BASE_URL = "https://raw.githubusercontent.com"
BASE_URL_ENV = "CARPOOL_TRACES_URL"
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Upstream:
    """Where one trace file is published: ``repo`` (owner/name) at
    ``commit``, ``path`` in that tree; ``sha256`` and ``size`` of the file
    there; ``licence``: its name and the file under ``excerpts/licenses``."""

    repo: str
    commit: str
    path: str
    sha256: str
    size: int
    licence: str
    licence_file: str

    def url(self, base_url: str = DEFAULT_BASE_URL) -> str:
        return f"{base_url.rstrip('/')}/{self.repo}/{self.commit}/{self.path}"


_AZURE = ("Azure/AzurePublicDataset", "b469a113cedca53ddc3bdea71a143dc4b7d8700c")
_MOONCAKE = ("kvcache-ai/Mooncake", "3b5a594133958449a1feaf1c9e0fc1b553e34a28")

UPSTREAM: MappingProxyType[str, Upstream] = MappingProxyType({
    "azure-conv": Upstream(
        *_AZURE, "data/AzureLLMInferenceTrace_conv.csv",
        "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", 719_188,
        "CC-BY-4.0", "AzurePublicDataset_LICENSE"),
    "azure-code": Upstream(
        *_AZURE, "data/AzureLLMInferenceTrace_code.csv",
        "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", 320_117,
        "CC-BY-4.0", "AzurePublicDataset_LICENSE"),
    "mooncake-conv": Upstream(
        *_MOONCAKE, "FAST25-release/traces/conversation_trace.jsonl",
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 3_029_533,
        "Apache-2.0", "Mooncake_LICENSE-APACHE"),
    "mooncake-synthetic": Upstream(
        *_MOONCAKE, "FAST25-release/traces/synthetic_trace.jsonl",
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 1_136_313,
        "Apache-2.0", "Mooncake_LICENSE-APACHE"),
    "sharegpt": Upstream(
        "microsoft/sarathi-serve", "72339db5b120614033b317880ad3a05a5e4c9415",
        "data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        "6d6c296302a853e2669a674a96f269283e60c57e60363bd450588a1066919f9f", 949_600,
        "Apache-2.0", "sarathi-serve_LICENSE"),
    "arxiv": Upstream(
        "microsoft/vidur", "7d47513363ec447a741ac5e47241580b47724fbf",
        "data/processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc", 884_932,
        "MIT", "vidur_LICENSE"),
})


class TraceDownloadError(RuntimeError):
    """A trace could not be fetched, or what came was not the pinned file."""


def download_traces(names: Iterable[str], dest: Path, base_url: str = DEFAULT_BASE_URL,
                    force: bool = False, progress: bool = True,
                    upstream: MappingProxyType | dict = UPSTREAM,
                    timeout: float = 60.0) -> list[Path]:
    """Fetch the traces ``names`` into ``dest`` (the layout of `TRACE_FILES`)
    and return their paths. A file already there with the pinned sha256 is
    kept (unless ``force``); a download replaces the target only once its
    size and sha256 match, so an interrupted or tampered transfer leaves
    nothing behind. The licence text of each goes to ``dest/licenses``."""
    dest = Path(dest)
    paths = []
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        for name in names:
            if name not in upstream:
                raise TraceDownloadError(f"unknown trace {name!r}; known: {', '.join(upstream)}")
            source = upstream[name]
            target = dest / TRACE_FILES[name][0]
            if force or not (target.is_file() and _sha256(target) == source.sha256):
                _fetch(client, source, source.url(base_url), target, name, progress)
            _copy_licence(source, dest)
            paths.append(target)
    return paths


def _fetch(client: httpx.Client, source: Upstream, url: str, target: Path, name: str,
           progress: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out, client.stream("GET", url) as response:
            if response.status_code != 200:
                raise TraceDownloadError(f"{name}: GET {url} answered HTTP "
                                         f"{response.status_code}")
            bar = tqdm(total=source.size, unit="B", unit_scale=True, desc=name,
                       disable=not progress, leave=False)
            with bar:
                for chunk in response.iter_bytes(_CHUNK):
                    size += len(chunk)
                    if size > source.size:
                        raise TraceDownloadError(f"{name}: {url} is larger than the pinned "
                                                 f"{source.size:,} bytes")
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
        if size != source.size or digest.hexdigest() != source.sha256:
            raise TraceDownloadError(
                f"{name}: {url} gave {size:,} bytes with sha256 {digest.hexdigest()}, not the "
                f"pinned {source.size:,} bytes with sha256 {source.sha256}; nothing was written")
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; a trace is an ordinary file
        os.replace(tmp_name, target)
    except httpx.HTTPError as exc:
        raise TraceDownloadError(f"{name}: GET {url} failed: {exc}") from None
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _copy_licence(source: Upstream, dest: Path) -> None:
    licences = dest / "licenses"
    licences.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(EXCERPTS_DIR / "licenses" / source.licence_file,
                    licences / source.licence_file)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()
