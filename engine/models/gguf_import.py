"""A GGUF file (llama.cpp's format, how many people hold a model) as a Hugging Face folder that `model.path`
loads: `import_gguf(FILE, OUT, dtype)` behind `rlflow model import`.

transformers reads GGUF (with the `gguf` package) and dequantizes its tensors, but refuses to save a model
it loaded that way (its config carries a `quantization_config`). So the weights go into a fresh model built
from the same config without it, cast to the chosen dtype, and that is saved as safetensors with the file's
tokenizer, chat template and generation config. `rlflow_import.json` records where it came from: the
file's name and sha256, the dtype, each saved weight file's sha256, the parameter count, transformers'
version. torch and transformers load only when a file is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

RECORD_FILE = "rlflow_import.json"
DTYPES = ("float32", "bfloat16", "float16")
_MAGIC = b"GGUF"  # every GGUF file starts with these four bytes (llama.cpp's gguf.md)


@dataclass(frozen=True)
class ImportReport:
    """What `rlflow_import.json` holds: the source file, the saved weights and the code that made them."""

    source: str  # the GGUF file's name
    source_sha256: str
    dtype: str
    weights_sha256: dict[str, str]  # each saved *.safetensors file's name -> sha256 of its bytes
    num_parameters: int
    architecture: str  # the model class transformers built (config.json's architectures)
    transformers: str
    seconds: float


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> ImportReport:
    """Convert `gguf_file` into the Hugging Face folder `out_dir` (absent or empty), weights in `dtype`.

    Refused before anything is written (engine.models.loading.ModelLoadError or ConfigError, one line): a
    dtype not in DTYPES, an `out_dir` that holds anything, a file that is not GGUF or that transformers
    cannot read, an architecture it cannot build. The folder appears whole or not at all (built in a
    temporary sibling, then renamed)."""
    from engine.models.loading import ModelLoadError

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: allowed: {', '.join(DTYPES)}")
    out = _empty_target(Path(out_dir).expanduser())
    source = Path(gguf_file).expanduser()
    check_gguf(source)
    start = time.monotonic()
    source_sha = file_sha256(source)
    model, tokenizer = _load_gguf(source)
    fresh = _fresh_copy(model, dtype)
    fresh.generation_config = model.generation_config
    del model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights = {f.name: file_sha256(f) for f in sorted(tmp.glob("*.safetensors"))}
        if not weights:
            raise ModelLoadError(f"{source.name}: transformers saved no safetensors file for it")
        report = ImportReport(
            source=source.name, source_sha256=source_sha, dtype=dtype, weights_sha256=weights,
            num_parameters=int(fresh.num_parameters()), architecture=type(fresh).__name__,
            transformers=_transformers_version(), seconds=round(time.monotonic() - start, 1))
        (tmp / RECORD_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
        _readable(tmp)
        os.rename(tmp, out)  # replaces an empty folder, fails on a full one (another import got there first)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def read_record(model_dir: str | Path) -> ImportReport:
    """The import record of a folder `import_gguf` wrote."""
    return ImportReport(**json.loads((Path(model_dir) / RECORD_FILE).read_text()))


def altered(model_dir: str | Path) -> str | None:
    """Why the folder is not what its import record says (a weight file missing, changed or added), or None."""
    folder = Path(model_dir)
    try:
        record = read_record(folder)
    except (OSError, ValueError, TypeError) as err:
        return f"its {RECORD_FILE} cannot be read ({type(err).__name__})"
    found = {f.name for f in folder.glob("*.safetensors")}
    if found != set(record.weights_sha256):
        return f"its weight files are {sorted(found)}, the record names {sorted(record.weights_sha256)}"
    for name, sha in record.weights_sha256.items():
        if file_sha256(folder / name) != sha:
            return f"{name} is not the file the import wrote"
    return None


def check_gguf(path: Path) -> None:
    """ModelLoadError (one line) unless `path` is a file that starts as a GGUF file does and whose header
    and tensor table the `gguf` package reads (the tensors themselves are read by transformers)."""
    from engine.models.loading import ModelLoadError

    allowed = "give a .gguf file (llama.cpp's format) of a model family transformers reads"
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file; {allowed}")
    with open(path, "rb") as stream:
        magic = stream.read(len(_MAGIC))
    if magic != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with {_MAGIC.decode()!r}); {allowed}")
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ModelLoadError("reading a GGUF file needs the gguf package: pip install 'rlflow[gguf]'") from err
    try:
        GGUFReader(str(path))  # a memory map: the header, the metadata and the tensor table, checked for size
    except Exception as err:  # noqa: BLE001  any failure to parse the file means the same: it cannot be read
        raise ModelLoadError(f"{path}: the gguf package cannot read it ({type(err).__name__}: {_first_line(err)}); "
                             f"{allowed}") from err


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(8 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


def _load_gguf(path: Path) -> tuple[Any, Any]:
    """transformers' model (fp32, dequantized) and tokenizer of the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.loading import ModelLoadError

    folder, name = str(path.parent.resolve()), path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)  # (local_files_only would be saved)
    except Exception as err:  # noqa: BLE001  an unsupported architecture is a ValueError, a broken tensor anything
        raise ModelLoadError(f"{path}: transformers {_transformers_version()} cannot load it as a causal LM "
                             f"({type(err).__name__}: {_first_line(err)}); give a .gguf file of a model family "
                             "transformers reads (its GGUF docs list them)") from err
    return model.eval(), tokenizer


def _fresh_copy(model: Any, dtype: str) -> Any:
    """A model of `model`'s class and config less its `quantization_config`, holding its weights, in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(fresh, "all_tied_weights_keys", {}) or {}) if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:  # a tied head is missing from the file's tensors, as it should be
        from engine.models.loading import ModelLoadError

        raise ModelLoadError(f"the GGUF weights do not fit {type(fresh).__name__}: missing {sorted(missing)[:4]}, "
                             f"unexpected {sorted(unexpected)[:4]}")
    fresh.tie_weights()
    return fresh.to(getattr(torch, dtype)).eval()


def _empty_target(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory: give a new or empty one")
    return out


def _readable(directory: Path) -> None:
    """mkdtemp makes the folder private (0700); a shared model cache should not be."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
