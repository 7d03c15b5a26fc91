"""Causal LMs and their tokenizers: where a model comes from, how it loads (without dropout).

`model.path` is a local Hugging Face directory, a hub id (only where the machine is online, or already
in the hub cache when `HF_HUB_OFFLINE` is set). "tiny", the project's own small model, is built by
the flows layer (engine.demo.tiny.resolve_model_path) before the engine sees the config.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

if TYPE_CHECKING:  # the model classes are imported where a model is loaded: the CLI's checks need none
    from transformers import PreTrainedModel

from engine.config import ModelConfig
from engine.errors import ConfigError, RLFlowError

log = logging.getLogger("rlflow.models")

TINY = "tiny"
TINY_HERE = ("{key}=tiny is the project's own demo model, which the flows layer builds (engine.demo.tiny) "
             "before the engine sees the config: the engine loads a model directory or a hub id")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelLoadError(RLFlowError):
    """A model or tokenizer could not be found or loaded."""


# ---------------------------------------------------------------------------------------------------
# where the model comes from


def cache_dir() -> Path:
    """`$RLFLOW_CACHE`, default `~/.cache/rlflow`."""
    return Path(os.environ.get("RLFLOW_CACHE") or Path.home() / ".cache" / "rlflow").expanduser()


def source_digest(*files: Path) -> str:
    """12 hex digits of the files' contents and the torch and transformers versions: the name a cached
    build carries of the code that made it, so an edit to its builder is never served an old build."""
    import transformers

    digest = hashlib.sha256(f"torch={torch.__version__};transformers={transformers.__version__}".encode())
    for path in files:
        digest.update(b"\0" + Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    return digest.hexdigest()[:12]


def hub_offline() -> bool:
    # Read at call time: huggingface_hub reads these variables once, at import.
    return any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model_path(model_cfg: ModelConfig) -> str:
    """A directory or hub id that `from_pretrained` can load. "tiny" is refused: the flows layer builds it
    (engine.demo.tiny.resolve_model_path) and hands the engine its directory."""
    seed = model_cfg.tiny_seed
    if model_cfg.path == TINY:
        raise ConfigError(TINY_HERE.format(key="model.path"))
    if seed != ModelConfig.model_fields["tiny_seed"].default:
        raise ConfigError(f"model.tiny_seed={seed} is not allowed with model.path={model_cfg.path!r}: it seeds the "
                          "built tiny model only (model.path=tiny)")
    return _resolve_pretrained(model_cfg.path, what="model.path", probe="config.json")


def resolve_tokenizer_path(model_cfg: ModelConfig) -> str:
    """`model.tokenizer_path` when set, else the model's own directory ("tiny" refused: see resolve_model_path)."""
    if model_cfg.tokenizer_path is None:
        return resolve_model_path(model_cfg)
    if model_cfg.tokenizer_path == TINY:
        raise ConfigError(TINY_HERE.format(key="model.tokenizer_path"))
    return _resolve_pretrained(
        model_cfg.tokenizer_path, what="model.tokenizer_path", probe="tokenizer_config.json"
    )


def resolve_reward_model_path(path: str) -> str:
    """reward.model.path as `from_pretrained` loads it (a local directory made absolute, or a hub id)."""
    return _resolve_pretrained(path, what="reward.model.path", probe="config.json")


def _resolve_pretrained(path: str, *, what: str, probe: str) -> str:
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local.resolve())  # absolute: Ray workers may run in another directory
    if local.exists():
        raise ConfigError(f"{what} {path!r} is a file; expected a Hugging Face model directory")
    if not _looks_like_hub_id(path):
        raise ConfigError(f"{what} {path!r}: no such directory")
    if hub_offline() and not _in_hub_cache(path, probe):
        raise ConfigError(
            f"{what} {path!r}: no such local directory, and the hub is offline (HF_HUB_OFFLINE) with no "
            "cached copy; give a local model directory, or 'tiny'"
        )
    return path


def _looks_like_hub_id(path: str) -> bool:
    # "org/name" or "name"; anything with more parts, or a path-like start, is a local path.
    if path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _in_hub_cache(repo_id: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return isinstance(found, str)


# ---------------------------------------------------------------------------------------------------
# loading


# What makes a model what it is: its weights and its config (not the tokenizer or the README).
_IDENTITY_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json", "config.json")


def model_identity(path: str) -> dict[str, Any]:
    """{"path", "sha256"}: the content hash of a model folder's weight files and config.json (names and
    bytes, in name order), which a LoRA run's adapters (and any run's reference model) depend on. A hub
    id is hashed in the local snapshot the workers load. Hashes are cached by the files' sizes, mtimes,
    ctimes and inodes, so a resume of a large model does not read it again."""
    import json

    folder = Path(path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=list(_IDENTITY_FILES), local_files_only=hub_offline()))
    files = sorted({f for pattern in _IDENTITY_FILES for f in folder.glob(pattern) if f.is_file()})
    # ctime and inode too: a file swapped for one of the same size and mtime (utime sets an mtime, never a
    # ctime) is hashed again.
    stamp = json.dumps([[f.name, (st := f.stat()).st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for f in files])
    cache = cache_dir() / "model-hashes"
    key = hashlib.sha256(f"{folder.resolve()}\n{stamp}".encode()).hexdigest()
    cached = cache / key
    if cached.is_file():
        return {"path": path, "sha256": cached.read_text().strip()}
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as stream:
            while chunk := stream.read(8 * 2**20):
                digest.update(chunk)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{key}.{os.getpid()}"
    tmp.write_text(digest.hexdigest())
    os.replace(tmp, cached)
    return {"path": path, "sha256": digest.hexdigest()}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"model.dtype {name!r}: allowed: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(path: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> PreTrainedModel:
    """A causal LM from a directory or hub id (see `resolve_model_path`), in eval mode, without dropout."""
    from transformers import AutoModelForCausalLM

    return _load(AutoModelForCausalLM, path, dtype=dtype, trust_remote_code=trust_remote_code,
                 what="a causal LM")


def load_value_model(path: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> PreTrainedModel:
    """The critic: the causal LM's trunk with one output per token (transformers' token-classification
    head, a new linear layer), in eval mode, without dropout (its head defaults to 0.1 otherwise)."""
    from transformers import AutoModelForTokenClassification

    return _load(AutoModelForTokenClassification, path, dtype=dtype, trust_remote_code=trust_remote_code,
                 what="a value model (token classification)", num_labels=1)


def _load(auto: Any, path: str, *, dtype: str, trust_remote_code: bool, what: str, **kwargs: Any
          ) -> PreTrainedModel:
    from transformers import AutoConfig

    local = hub_offline() or Path(path).expanduser().is_dir()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=local,
                                            **kwargs)
        model = auto.from_pretrained(path, config=without_dropout(config), dtype=torch_dtype(dtype),
                                     trust_remote_code=trust_remote_code, local_files_only=local)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load {what} from {path!r}: {first_line(err)}") from err
    zero_dropout(model)
    return model.eval()


def without_dropout(config: PretrainedConfig) -> PretrainedConfig:
    """`config` (changed in place) with every dropout probability 0, sub-configs included, and the
    classification heads' `classifier_dropout` set (it defaults to 0.1 when absent).

    RL needs deterministic forward passes in train mode: the log-probs of the update must be the
    log-probs the ratio compares with, and the critic's values feed GAE and value clipping. verl
    does the same (`attention_dropout: 0` and friends in its model overrides)."""
    for cfg in _configs(config):
        for key, value in list(vars(cfg).items()):
            if _is_dropout_name(key) and isinstance(value, float) and not isinstance(value, bool):
                setattr(cfg, key, 0.0)
    config.classifier_dropout = 0.0
    return config


def zero_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every `nn.Dropout*` module gets p = 0, and float attributes named like a dropout probability
    (attention modules read `self.attention_dropout` at call time) become 0: what a config override
    cannot reach (remote code, hard-coded rates) is caught here."""
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if _is_dropout_name(key) and isinstance(value, float):
                setattr(module, key, 0.0)
    return model


def dropout_left(model: torch.nn.Module) -> list[str]:
    """Where `model` would still drop anything: modules or config keys with a positive rate."""
    found = [f"{name or type(model).__name__}.p={m.p}" for name, m in model.named_modules()
             if isinstance(m, _DROPOUTS) and m.p > 0]
    for name, module in model.named_modules():
        found += [f"{name}.{k}={v}" for k, v in vars(module).items()
                  if _is_dropout_name(k) and isinstance(v, float) and v > 0]
    config = getattr(model, "config", None)
    if config is not None:
        found += [f"config.{k}={v}" for cfg in _configs(config) for k, v in vars(cfg).items()
                  if _is_dropout_name(k) and isinstance(v, float) and v > 0]
    return found


_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)


def _is_dropout_name(key: str) -> bool:
    # attention_dropout, hidden_dropout, classifier_dropout, resid_pdrop, embd_pdrop, attn_pdrop, ...
    return "dropout" in key or key.endswith("pdrop")


def _configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    """`config` and its sub-configs (text_config, vision_config, ... of multimodal families)."""
    found = [config]
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            found += _configs(value)
    return found


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer at `path`, left padding, with a pad token (eos when it has none). Always through
    AutoTokenizer: it picks the family's own class from the model's config where the tokenizer config
    names only the generic fast one (building that generic class directly tokenized Qwen2's prompts
    differently)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path,
            trust_remote_code=trust_remote_code,
            local_files_only=hub_offline() or Path(path).expanduser().is_dir(),
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {first_line(err)}") from err
    return prepare_tokenizer(tokenizer)


def load_model_and_tokenizer(model_cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Both halves of `model_cfg` (a directory or hub id each: see resolve_model_path)."""
    model = load_model(
        resolve_model_path(model_cfg),
        dtype=model_cfg.dtype,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    tokenizer = load_tokenizer(
        resolve_tokenizer_path(model_cfg), trust_remote_code=model_cfg.trust_remote_code
    )
    align_generation_config(model, tokenizer)
    return model, tokenizer


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding (prompts end in the same column) and a pad token; changes `tokenizer` in place."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelLoadError(
                f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token; cannot pad batches"
            )
        tokenizer.pad_token = tokenizer.eos_token
        log.info(
            "tokenizer %r has no pad token: using eos %r (id %d) as pad",
            tokenizer.name_or_path,
            tokenizer.eos_token,
            tokenizer.eos_token_id,
        )
    return tokenizer


def align_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """`generate` pads with the tokenizer's pad id (silences its 'setting pad_token_id' warning)."""
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def empty_model(path: str, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM at `path` without its weights (on the meta device: names and shapes only), with its
    saved generation config (its eos ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # none saved: the config's
        pass
    return model
