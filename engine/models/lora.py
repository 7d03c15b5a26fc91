"""LoRA through peft: adapters on a frozen base model, as verl and TRL train them.

The engine shards and runs the *inner* model (the transformers model with peft's LoRA layers
injected), so every code path of full fine-tuning (forward layouts, generation, checkpointing under
FSDP2) runs unchanged; the PeftModel around it is kept to switch the adapters off (the reference
policy is the base model: the same weights, no second copy) and to write peft's adapter folder.

Parameter names are the inner model's (`model.layers.0.self_attn.q_proj.lora_A.default.weight`): the
names in checkpoints, in the rollout copy and in the gathered adapter state.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from engine.config import LoraConfig
from engine.errors import ConfigError


def apply_lora(model: nn.Module, cfg: LoraConfig, *, task: str, what: str) -> tuple[nn.Module, Any]:
    """(the inner model with adapters, its PeftModel). `task`: "CAUSAL_LM" (the actor) or "TOKEN_CLS"
    (the critic: its value head is trained in full, peft's modules_to_save for that task). Only the
    adapters and `cfg.modules_to_save` require gradients. `what` names the setting in errors."""
    import peft

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} | {name for name, _ in model.named_modules()}
    linear = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}))
    if cfg.target_modules != "all-linear":
        missing = [m for m in cfg.target_modules if m not in names]
        if missing:  # peft refuses only when none of them is found
            raise ConfigError(f"{what}: {missing[0]!r} is not a module of {type(model).__name__}; its linear layers: "
                              f"{linear} (or all-linear)")
    unknown = [m for m in cfg.modules_to_save if m not in names]
    if unknown:  # peft would skip them silently
        raise ConfigError(f"{what.rsplit('.', 1)[0]}.modules_to_save: {unknown[0]!r} is not a module of "
                          f"{type(model).__name__}; its modules include: "
                          f"{', '.join(sorted(n for n in names if n and not n.isdigit() and '.' not in n))}")
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=cfg.target_modules, modules_to_save=list(cfg.modules_to_save) or None,
                             task_type=task, bias="none",
                             # the critic's value head is trained in full (peft's modules_to_save for TOKEN_CLS)
                             exclude_modules=_HEADS if task == "TOKEN_CLS" else None)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as err:
        raise ConfigError(f"{what}: {str(err).splitlines()[0]} (the model's linear layers: {linear}; "
                          "or all-linear)") from err
    inner = wrapped.base_model.model
    assert isinstance(inner, nn.Module)
    return inner, wrapped


_HEADS = ["score", "classifier"]  # transformers' names of a token-classification head


@contextmanager
def adapters_disabled(peft_model: Any) -> Iterator[None]:
    """The base model: every adapter off (LoRA layers return their base layer's output, modules_to_save
    their original module's), so a forward equals the base model's exactly; on again after."""
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    with peft_model.disable_adapter():
        yield
    # peft switches requires_grad off and on with the adapters: the trainable set must come back as it was
    if {id(p) for p in peft_model.parameters() if p.requires_grad} != {id(p) for p in trainable}:
        raise RuntimeError("the trainable parameters changed while the adapters were disabled")


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters (the adapters and modules_to_save) of the inner model."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def save_adapter_folder(base: nn.Module, cfg: LoraConfig, adapters: dict[str, torch.Tensor], out: str, *,
                        task: str, base_path: str) -> Any:
    """peft's adapter folder (adapter_config.json + adapter_model.safetensors) at `out`, made from the
    base model `base` (unsharded, one process) and the gathered adapter state (inner-model names); it
    loads with `peft.PeftModel.from_pretrained(base, out)`. Returns the PeftModel (for merging)."""
    inner, wrapped = apply_lora(base, cfg, task=task, what="lora")
    missing = set(adapter_names(inner)) - set(adapters)
    if missing:
        raise RuntimeError(f"the adapter state lacks {sorted(missing)[:3]}")
    inner.load_state_dict(adapters, strict=False)
    wrapped.peft_config["default"].base_model_name_or_path = base_path
    wrapped.save_pretrained(out)
    return wrapped
