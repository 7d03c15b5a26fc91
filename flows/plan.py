"""Turn a config into a run: check every input, resolve the model and data, open the run in storage.

Everything that can be wrong with the input (config, data files, rows, prompt lengths, the model, a
`--resume` that does not match) is checked here, BEFORE anything is written to the run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import RewardConfig
from engine.cpu_kernels import kernel_env
from engine.errors import ConfigError, RewardError
from flows.config import RLConfig, build_config, load_config
from infra.config import StorageConfig
from infra.errors import StoreUnavailable
from infra.layout import check_run_id
from infra.runs import Lease, RunStore
from infra.store import ObjectStore

if TYPE_CHECKING:  # the engine, Ray and the model classes are imported where a check needs them: a bad
    # setting, run id or data file is answered in about 2 s instead of 6 (2 cores)
    from engine.data.prompts import PromptDataset
    from engine.engine import EngineSpec
    from tasks.context import RunPlan

log = logging.getLogger("rlflow.train")


@dataclass
class OpenRun:
    plan: RunPlan
    cfg: RLConfig
    store: ObjectStore
    runs: RunStore
    lease: Lease
    resumed: bool


# How many train rows the reward preflight scores, each with an empty response and its ground truth.
REWARD_PREFLIGHT_ROWS = 4
# A start-up probe of storage gives up sooner than the retries meant to ride out blips mid-run.
_PROBE_ATTEMPTS = 3
_PROBE_CONNECT_TIMEOUT_S = 5.0


@dataclass
class CheckedInputs:
    """What `check_inputs` found; nothing of it has been written anywhere."""

    store: ObjectStore
    runs: RunStore
    model_path: str
    tokenizer_path: str
    train: PromptDataset
    val: PromptDataset | None
    engine: EngineSpec
    base_model: dict[str, Any]  # engine.models.loading.model_identity of the policy's model


def new_run_id(cfg: RLConfig) -> str:
    return cfg.trainer.run_id or f"{cfg.trainer.project}-{time.strftime('%Y%m%d-%H%M%S')}"


# What a run executes, or where it writes its own files: always the launching user's config and command
# line (or a deployment's parameters), never a stored record (whoever can write the bucket writes run.json).
CODE_SETTINGS = ("reward.function", "reward.cost_function", "algorithm.extra_stages", "rollout.multi_turn.tools",
                 "rollout.env", "rollout.agent", "model.trust_remote_code", "reward.model.trust_remote_code", "trainer.log_dir", "trainer.loggers")
# Where the run's storage is: where the user found the run, never what run.json says (on S3 an endpoint).
USER_STORAGE = ("root", "endpoint_url", "region", "shared_fs")


def resume_config(store: ObjectStore, run_id: str, cfg: RLConfig | None, overrides: list[str],
                  storage: StorageConfig | None = None) -> RLConfig:
    """The config of a resumed run: its run.json snapshot with `overrides`, or `cfg` if it keeps the model.

    What the user gives is CONFIG, the overrides, else the default config. The CODE_SETTINGS are always the
    user's: one that run.json gives otherwise is refused before anything runs. Every other stored setting is
    taken from run.json only when the record is signed with this user's record key (infra/record_key.py);
    from an unsigned record, a setting that differs from what the user gives is refused (docs/security.md).
    The storage's place (USER_STORAGE) is `storage`, the user's, either way."""
    from flows.config import parse_override, set_dotted

    runs = RunStore(store, check_run_id(run_id))
    if not runs.exists():
        raise ConfigError(f"--resume {run_id}: no run {run_id!r} under {store.url()}")
    info, unsigned = runs.read_signed_run_info()
    saved = info["config"]
    given = {parse_override(item)[0] for item in overrides}
    users = (cfg or load_config(None, [])).model_dump(mode="json")  # what the user gives where no override
    # Before the stored config is validated: a tampered value is refused as such, whatever else it breaks.
    _check_code_settings(run_id, saved, users, [key for key in CODE_SETTINGS if key not in given])
    if unsigned is not None:
        _check_unsigned(run_id, saved, users, given, unsigned)
    if cfg is None:
        raw = json.loads(json.dumps(saved))  # a deep copy: the overrides must not edit `saved` itself
        for item in overrides:
            key, value = parse_override(item)
            set_dotted(raw, key, value)
        if storage is not None:  # where the user found the run, never where run.json says
            raw["storage"].update(storage.model_dump(mode="json", include=set(USER_STORAGE)))
        cfg = build_config(raw)
    ours = cfg.model_dump(mode="json")
    _check_code_settings(run_id, saved, ours, [key for key in CODE_SETTINGS if key in given])
    changed = [k for k in ("path", "tokenizer_path", "dtype", "tiny_seed") if saved["model"].get(k) !=
               cfg.model.model_dump(mode="json").get(k)]
    if changed:
        key = f"model.{changed[0]}"
        raise ConfigError(f"--resume {run_id}: the config changes {key} from {saved['model'].get(changed[0])!r} "
                          f"to {getattr(cfg.model, changed[0])!r}; a run keeps its model (start a new run)")
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_id": run_id})})


def _check_code_settings(run_id: str, saved: dict[str, Any], mine: dict[str, Any], keys: list[str]) -> None:
    """ConfigError when run.json gives one of `keys` (CODE_SETTINGS) otherwise than the user (`mine`)."""
    for key in keys:
        stored, given = _canonical(_dotted(saved, key)), _dotted(mine, key)
        if stored != given:
            raise ConfigError(f"--resume {run_id}: run.json has {key}={stored!r} where your config and command line "
                              f"give {given!r}; what a run executes is never taken from storage: give {key} "
                              "yourself to resume with it")


def _check_unsigned(run_id: str, saved: dict[str, Any], mine: dict[str, Any], given: set[str], why: str) -> None:
    """ConfigError naming the first setting an unsigned run.json gives otherwise than the user (`mine`, where
    no override in `given` sets it): such a record decides nothing. Left out: the run id (the run's own), the
    storage's place (the user's always), overridden settings (the override is applied over the record) and
    keys no config has (the config's own check of keys refuses them next). A setting the record does not
    hold (written by an older rlflow) is the user's: nothing to compare."""
    for key, stored in _leaves(saved):
        if key == "trainer.run_id" or key.removeprefix("storage.") in USER_STORAGE:
            continue
        if any(key == g or key.startswith(g + ".") for g in given):
            continue
        yours = _dotted(mine, key)
        if yours is None and not _has(mine, key):
            continue
        if _canonical(stored) != yours:
            raise ConfigError(f"--resume {run_id}: run.json has {key}={_canonical(stored)!r} where your config and "
                              f"command line give {yours!r}, and its settings are not taken because {why} (it "
                              "was not written with your record key, infra/record_key.py): resume with the config "
                              "and overrides the run began with, or with its key in $RLFLOW_RECORD_KEY")


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _has(tree: Any, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _canonical(value: Any) -> Any:
    """A stored spec (or list of specs) naming a module that moved (engine.imports.MOVED) as the config now
    writes it: a run started before the move resumes with the spec it was given."""
    from engine.imports import canonical_spec

    if isinstance(value, str):
        return canonical_spec(value)
    if isinstance(value, list):
        return [canonical_spec(v) if isinstance(v, str) else v for v in value]
    return value


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def resolve_config(config_path: str | None, overrides: list[str], resume: str | None) -> tuple[RLConfig, str]:
    """The config and run id of `rlflow train`: a new run's from CONFIG and the overrides; a resumed
    run's from its run.json plus the overrides (or from CONFIG when one is given), its model unchanged."""
    if resume is None:
        cfg = load_config(config_path, overrides)
        return cfg, new_run_id(cfg)
    base = load_config(config_path, overrides) if config_path else None
    probe = base or load_config(None, [o for o in overrides if o.startswith("storage.")])
    store = probe_store(probe.storage)
    with _reachable(store):
        return resume_config(store, resume, base, overrides, probe.storage), resume


def check_inputs(cfg: RLConfig, run_id: str, *, resume: bool) -> CheckedInputs:
    """Every check of the run's inputs, writing nothing: storage reachable with these credentials, the
    run id free (new run), model and tokenizer, data rows and prompt lengths, batch size, the engine
    and stage list, and the reward on a few real rows. `rlflow train` calls it before the stack starts;
    `open_run` calls it again (a deployment's run comes without the CLI)."""
    from engine.data.prompts import load_train_val
    from engine.demo.tiny import resolve_model_path, resolve_tokenizer_path
    from engine.models.loading import cache_dir, load_tokenizer, model_identity, resolve_reward_model_path
    from engine.models.tokens import prompt_lengths
    from engine.rollout.tools import describe, load_tools
    from flows.algorithms import stages_for

    check_run_id(run_id)
    check_stage_timeouts(cfg)
    probe = probe_store(cfg.storage)
    with _reachable(probe):
        exists = RunStore(probe, run_id).exists()
    store = ObjectStore.from_config(cfg.storage)
    runs = RunStore(store, run_id)
    if not resume and exists:
        raise ConfigError(f"run {run_id!r} already exists under {store.url()}: resume it with "
                          f"--resume {run_id}, or choose another trainer.run_id")
    if resume and not exists:
        raise ConfigError(f"--resume {run_id}: no run {run_id!r} under {store.url()}")
    kernels = kernel_env(cfg.placement.cpu_kernels)  # the ranks' kernels (flows.train.worker_env)
    model_path = resolve_model_path(cfg.model, cfg.data.task, kernels)
    tokenizer_path = resolve_tokenizer_path(cfg.model, cfg.data.task, kernels)
    if cfg.model.trust_remote_code:
        check_has_code("model.trust_remote_code", model_path, tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)
    tools = describe(load_tools(cfg.rollout.multi_turn.tools)) if cfg.rollout.multi_turn.enable else None
    if cfg.teacher.path is not None:  # distillation: the teacher reads the student's tokens
        check_teacher(cfg.teacher.path, tokenizer, cfg.model.trust_remote_code)
    if cfg.rollout.env is not None:  # the class is imported in the sandbox, as its episodes will import it
        from engine.rollout.envs import EnvLimits, check_chat_template, check_env, env_files

        check_chat_template(tokenizer)
        mt = cfg.rollout.multi_turn
        check_env(cfg.rollout.env, EnvLimits(mt.env_step_timeout_s, mt.env_memory_mb, cfg.reward.sandbox.isolation),
                  env_files(cfg.rollout.env))
    if cfg.rollout.agent is not None:  # the function is imported in the sandbox, as its episodes will import it
        from engine.rollout.agents import check_agent
        from engine.rollout.envs import EnvLimits, check_chat_template, env_files

        check_chat_template(tokenizer)
        mt = cfg.rollout.multi_turn
        check_agent(cfg.rollout.agent, EnvLimits(mt.env_step_timeout_s, mt.env_memory_mb, cfg.reward.sandbox.isolation),
                    env_files(cfg.rollout.agent))
    synthetic = None
    objective = cfg.algorithm.objective
    sft = objective in ("sft", "dpo")  # SFT's conversations or DPO's pairs: no prompts, no reward
    if not cfg.data.train_files:  # the synthetic data.task: demo code, its files written here
        from engine.demo.data import ensure_demonstrations, ensure_synthetic_data

        made = cache_dir() / "data", cfg.data.train_size, cfg.data.val_size, cfg.data.seed
        synthetic = (ensure_demonstrations(cfg.data.task, *made, kind=objective) if sft else
                     ensure_synthetic_data(cfg.data.task, *made))
    if sft:
        train, val = _conversations(cfg, tokenizer, synthetic)
    else:
        train, val = load_train_val(cfg.data, length_fn=lambda p: prompt_lengths(tokenizer, [p], tools)[0],
                                    synthetic_files=synthetic)
    if len(train) < cfg.data.train_batch_size:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the training set "
                          f"({len(train)} {'rows' if sft else 'prompts'} after filtering): lower it or add data")
    engine = engine_spec(cfg, run_id, model_path, tokenizer_path)
    if cfg.ray.address is None:  # the local stack: every rank runs on this machine (an external cluster: its own)
        from engine.workers.memory import check_memory

        check_memory(engine.policy, engine.critic, world_size=engine.world_size, rollout_ranks=engine.rollout_ranks)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # the CLI checks again once the stack is up; a flow run has Ray
        from engine.engine import check_fits

        check_fits(engine, ray.cluster_resources())
    check_lora(cfg, model_path)
    if cfg.rollout.name == "vllm":
        from engine.rollout.vllm import check_servable

        engines = cfg.trainer.world_size + (cfg.placement.rollout_ranks if cfg.placement.mode == "split" else 0)
        check_servable(model_path, cfg.rollout.vllm, engines=engines, lora_saved=cfg.actor.lora.modules_to_save)
    identity = model_identity(model_path)
    if resume:
        check_same_base(runs, run_id, identity)
    stages_for(cfg)  # refuses a stage that reads a column nobody writes
    if cfg.rollout.episodes is None and not sft:  # with an environment or an agent, that gives the reward
        from engine.rewards.registry import check_format_weight  # imported only when checking

        check_reward(train, cfg.reward)
        check_format_weight(cfg.reward, [r.data_source for d in (train, val) if d is not None for r in d.rows])
    if cfg.reward.cost_function is not None:  # safe RL's cost is scored as a reward is
        check_reward(train, cfg.reward.model_copy(update={"function": cfg.reward.cost_function,
                                                          "overlong_buffer_len": 0}))
    if cfg.reward.model.path is not None:
        from engine.rewards.reward_model import check_reward_model

        rm_path = resolve_reward_model_path(cfg.reward.model.path)
        if cfg.reward.model.trust_remote_code:
            check_has_code("reward.model.trust_remote_code", rm_path)
        check_reward_model(rm_path, cfg.reward.model.trust_remote_code)
    return CheckedInputs(store, runs, model_path, tokenizer_path, train, val, engine, identity)


def check_has_code(setting: str, *folders: str) -> None:
    """ConfigError when `setting` (trust_remote_code=true) would trust local folders that hold no code of their
    own (no auto_map in config.json or tokenizer_config.json): it would change nothing. A hub id is not
    checked (its files are not here before the download)."""
    local = [Path(f) for f in folders if Path(f).is_dir()]
    if len(local) < len(folders):
        return
    for folder in local:
        for name in ("config.json", "tokenizer_config.json"):
            try:
                if "auto_map" in json.loads((folder / name).read_text()):
                    return
            except (OSError, ValueError):
                continue
    raise ConfigError(f"{setting}=True is not allowed: {', '.join(sorted(set(folders)))} has no code of its own (no "
                      "auto_map in config.json or tokenizer_config.json), so there is nothing to trust")


def check_same_base(runs: RunStore, run_id: str, identity: dict[str, Any]) -> None:
    """A resumed run loads its base model again (the frozen weights under LoRA adapters, the reference
    model): it must be the same bytes as when the run began (run.json's base_model)."""
    recorded = runs.read_run_info().get("base_model")
    if recorded and recorded.get("sha256") != identity["sha256"]:
        raise ConfigError(
            f"--resume {run_id}: the base model at {identity['path']} is not the one the run began with "
            f"(sha256 {identity['sha256'][:12]}..., run.json records {recorded['sha256'][:12]}... of "
            f"{recorded['path']}); a run keeps its base model: put those weights back, or start a new run")


def check_lora(cfg: RLConfig, model_path: str) -> None:
    """LoRA's target and saved modules exist in the model: tried on an empty (meta) copy of it, before
    anything starts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from engine.models import lora
    from engine.models.loading import without_dropout

    for role, section, auto, task in (("actor", cfg.actor, AutoModelForCausalLM, "CAUSAL_LM"),
                                      ("critic", cfg.critic, AutoModelForTokenClassification, "TOKEN_CLS")):
        if not section.lora.enabled:
            continue
        path = (cfg.critic.model_path or model_path) if role == "critic" else model_path
        kwargs = {"num_labels": 1} if role == "critic" else {}
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code, **kwargs)
        with torch.device("meta"):
            empty = auto.from_config(without_dropout(config), trust_remote_code=cfg.model.trust_remote_code)
        try:
            lora.apply_lora(empty, section.lora, task=task, what=f"{role}.lora.target_modules")
        except (TypeError, KeyError, AttributeError) as err:  # peft's answer to bad modules_to_save
            raise ConfigError(f"{role}.lora.modules_to_save={section.lora.modules_to_save}: {err}") from err


def check_reward(train: PromptDataset, reward: RewardConfig, n: int = REWARD_PREFLIGHT_ROWS) -> None:
    """Score the first `n` train rows with an empty response and with their own ground truth: a reward
    that raises or returns NaN or a non-number fails here, naming data_source, row and value, before
    anything is written — not minutes later in the first reward stage."""
    from engine.rewards import score_batch  # the reward registry: imported only when checking

    rows = train.rows[:n]
    where = f"{rows[0].origin}..{rows[-1].origin}" if len(rows) > 1 else rows[0].origin
    truths = [r.ground_truth if isinstance(r.ground_truth, str) else json.dumps(r.ground_truth) for r in rows]
    for label, responses in (("an empty response", [""] * len(rows)), ("the ground truth as response", truths)):
        try:
            score_batch([r.data_source for r in rows], responses, [r.ground_truth for r in rows],
                        [r.extra_info for r in rows], cfg=reward)
        except RewardError as err:
            raise RewardError(f"reward check before the run, {label} on train rows {where}: {err}") from err


def probe_store(storage: StorageConfig) -> ObjectStore:
    """The store with few, short tries: a start-up check of an unreachable endpoint fails in seconds."""
    return ObjectStore.from_config(storage.model_copy(update={
        "retry_attempts": min(storage.retry_attempts, _PROBE_ATTEMPTS),
        "connect_timeout_s": min(storage.connect_timeout_s, _PROBE_CONNECT_TIMEOUT_S)}))


@contextmanager
def _reachable(store: ObjectStore) -> Iterator[None]:
    """Name the setting to check when storage cannot be reached at all."""
    try:
        yield
    except StoreUnavailable as err:
        where = f" at {store.endpoint_shown}" if store.endpoint_url else ""
        raise StoreUnavailable(f"storage.root={store.root} is unreachable{where} ({err}); check "
                               "storage.endpoint_url (or AWS_ENDPOINT_URL) and that the server is up") from err


def open_run(cfg: RLConfig, run_id: str, *, resume: bool, parent: dict[str, Any] | None = None) -> OpenRun:
    """Check the inputs, then take the run's lease and write run.json (a new run) — in that order."""
    from flows.algorithms import stages_for
    from tasks.context import RunPlan

    inputs = check_inputs(cfg, run_id, resume=resume)
    runs, train, val = inputs.runs, inputs.train, inputs.val
    lease = runs.acquire_lease(cfg.storage.lease_ttl_s)
    lease.start_renewing()
    try:
        if not resume:
            runs.write_run_info(cfg.public_dict(), code_version=code_version(), parent=parent,
                                config_hash=cfg.config_hash(), base_model=inputs.base_model)
        created = str(runs.read_run_info()["created"])
    except BaseException:
        lease.release()
        raise
    stages = stages_for(cfg)
    plan = RunPlan(
        run_id=run_id, created=created, config_hash=cfg.config_hash(), model_path=inputs.model_path,
        tokenizer_path=inputs.tokenizer_path, train_files=list(train.sources),
        val_files=list(val.sources) if val is not None else [],
        engine=inputs.engine, data=cfg.data, rollout=cfg.rollout,
        algorithm=cfg.algorithm, reward=cfg.reward, stages=stages, max_staleness=cfg.trainer.max_staleness,
        stage_timeouts={name: cfg.stage_timeout(name) for name in stage_names(stages)},
        retry_delays_s=cfg.trainer.stage_retry_delays_s,
        # An absolute root: the stages run in Ray workers whose working directory is not this one.
        storage=cfg.storage.model_copy(update={"access_key_id": None, "secret_access_key": None,
                                               "root": inputs.store.url()}),
        debug=cfg.debug,
    )
    return OpenRun(plan, cfg, inputs.store, runs, lease, resume)


OUTSIDE_THE_GRAPH = ("save_checkpoint", "validate")  # stages of every run besides the iteration's graph


def stage_names(stages: list[Any]) -> list[str]:
    return [*(s.name for s in stages), *OUTSIDE_THE_GRAPH]


def check_stage_timeouts(cfg: RLConfig) -> None:
    """trainer.stage_timeouts names stages of this run only: a typo must not leave a stage at the default."""
    from flows.algorithms import stages_for

    known = stage_names(stages_for(cfg))
    for name in cfg.trainer.stage_timeouts:
        if name not in known:
            raise ConfigError(f"trainer.stage_timeouts.{name}: this run has no stage {name!r}; its stages: "
                              f"{', '.join(known)}")


def rank_threads(cfg: RLConfig) -> int:
    """The torch threads of every rank: placement.cpus_per_rank, else this machine's CPUs shared out."""
    rollout_ranks, rm_ranks = pool_ranks(cfg)
    ranks = cfg.trainer.world_size + rollout_ranks + rm_ranks
    return cfg.placement.cpus_per_rank or max(1, (os.cpu_count() or 1) // ranks)


def pool_ranks(cfg: RLConfig) -> tuple[int, int]:
    """The ranks of the rollout pool and of the reward-model pool (0: none)."""
    rollout_ranks = cfg.placement.rollout_ranks if cfg.placement.mode == "split" else 0
    rm_ranks = cfg.reward.model.ranks if cfg.reward.model.enabled and cfg.reward.model.placement == "pool" else 0
    return rollout_ranks, rm_ranks


def check_teacher(path: str, tokenizer: Any, trust_remote_code: bool) -> None:
    """On-policy distillation compares the teacher's and the student's log-probs token by token: the teacher
    must be a model folder whose tokenizer is the student's (the same ids for the same strings)."""
    from engine.models.loading import load_tokenizer

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"teacher.path={path!r} is not allowed: no model folder there (a config.json); give a "
                          "local Hugging Face causal LM")
    theirs = load_tokenizer(path, trust_remote_code=trust_remote_code)
    mine, other = tokenizer.get_vocab(), theirs.get_vocab()
    differ = sum(1 for token, i in mine.items() if other.get(token) != i) + sum(1 for t in other if t not in mine)
    if differ or theirs.pad_token_id != tokenizer.pad_token_id or theirs.eos_token_id != tokenizer.eos_token_id:
        raise ConfigError(f"teacher.path={path!r} is not allowed: its tokenizer differs from the student's ({differ} "
                          f"of {max(len(mine), len(other))} tokens differ, or the pad or end token): distillation "
                          "compares log-probs token by token, so teacher and student need the same tokenizer")


def _conversations(cfg: RLConfig, tokenizer: Any, synthetic: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """algorithm.objective=sft or dpo: the train and validation conversations (engine.data.conversations) or
    preference pairs (engine.data.preferences), checked with the run's tokenizer: its chat template must
    mark the assistant's tokens."""
    from engine.data.conversations import load_conversations
    from engine.data.preferences import load_preferences

    data = cfg.data
    train_files, val_files = list(data.train_files), list(data.val_files)
    if synthetic is not None:
        train_files, val_files = [str(synthetic[0])], val_files or [str(synthetic[1])]

    def load(files: list[str], split: str) -> Any:
        loader = load_conversations if cfg.algorithm.objective == "sft" else load_preferences
        return loader(files, split=split, tokenizer=tokenizer, max_length=data.max_length, truncation=data.truncation)

    return load(train_files, "train"), (load(val_files, "val") if val_files else None)


def engine_spec(cfg: RLConfig, run_id: str, model_path: str, tokenizer_path: str) -> EngineSpec:
    """The engine of this run: policy (+ ref when a KL term is on) and, for PPO, a critic."""
    from engine.engine import EngineSpec
    from engine.models.loading import resolve_reward_model_path
    from engine.rewards.reward_model import RewardModelSpec
    from engine.workers.specs import CriticSpec, PolicySpec

    device = resolve_device(cfg.trainer.device)
    if device != "cpu":
        raise ConfigError(f"trainer.device={cfg.trainer.device!r} is not allowed yet: it means {device}, and "
                          "the GPU path is not built and tested; use cpu")
    place = cfg.placement
    threads = rank_threads(cfg)
    rollout_ranks, rm_ranks = pool_ranks(cfg)
    # The ranks get the correction's mode resolved (auto: truncate for an asynchronous run, else none).
    actor = cfg.actor.model_copy(update={"rollout_correction": cfg.actor.rollout_correction.model_copy(
        update={"mode": cfg.rollout_correction_mode})})
    if cfg.algorithm.objective == "dpo":  # the loss is a mean over pairs: micro-batches weigh by their pairs
        actor = actor.model_copy(update={"loss_agg_mode": "seq-mean-token-sum"})
    policy = PolicySpec(
        model_path=model_path, tokenizer_path=tokenizer_path, dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code, rollout=cfg.rollout, actor=actor, ref=cfg.ref,
        use_ref=cfg.needs_ref, total_iterations=cfg.trainer.total_iterations, seed=cfg.trainer.seed,
        sandbox_isolation=cfg.reward.sandbox.isolation, max_model_len=cfg.max_model_len,
        max_prompt_length=cfg.data.max_prompt_length, objective=cfg.algorithm.objective,
        dpo_loss=cfg.algorithm.dpo_loss, dpo_beta=cfg.algorithm.dpo_beta, ipo_logratio=cfg.algorithm.ipo_logratio,
        teacher_path=str(Path(cfg.teacher.path).resolve()) if cfg.teacher.path else None,
        teacher_micro_batch_size=cfg.teacher.micro_batch_size,
    )
    rm_cfg = cfg.reward.model
    reward_model = None
    if rm_cfg.enabled:
        assert rm_cfg.path is not None
        reward_model = RewardModelSpec(path=resolve_reward_model_path(rm_cfg.path),
                                       tokenizer_path=(resolve_reward_model_path(rm_cfg.tokenizer_path)
                                                       if rm_cfg.tokenizer_path else None), dtype=rm_cfg.dtype,
                                       trust_remote_code=rm_cfg.trust_remote_code,
                                       micro_batch_size=rm_cfg.micro_batch_size, max_length=rm_cfg.max_length)
    if rm_cfg.placement == "colocated":
        policy = policy.model_copy(update={"reward_model": reward_model})
    critic = None
    if cfg.critic.enable:
        critic = CriticSpec(
            model_path=cfg.critic.model_path or model_path, dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code, critic=cfg.critic,
            max_response_length=cfg.rollout.max_new_tokens, total_iterations=cfg.trainer.total_iterations,
            seed=cfg.trainer.seed,
        )
    timeout_s, timeout_setting = cfg.stage_timeout()
    return EngineSpec(
        run_id=run_id, config_hash=cfg.config_hash(), world_size=cfg.trainer.world_size,
        num_cpus_per_rank=float(threads), placement=cfg.ray.placement, namespace=cfg.ray.namespace,
        timeout_s=timeout_s, timeout_setting=timeout_setting, capacity_timeout_s=cfg.trainer.capacity_timeout_s,
        policy=policy, critic=critic, rollout_ranks=rollout_ranks,
        rollout_num_cpus_per_rank=float(threads), sync_bucket_mb=place.sync_bucket_mb,
        reward_model=reward_model if rm_ranks else None, reward_model_ranks=rm_ranks,
        reward_model_num_cpus_per_rank=float(threads),
    )


def resolve_device(device: str) -> str:
    """`auto`: cuda when a GPU is visible, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def code_version() -> str:
    """The git commit of this checkout when there is one, else the package version."""
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return f"git:{out.stdout.strip()}"
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"rlflow {version('rlflow')}"
    except PackageNotFoundError:
        return "unknown"


def public_plan(plan: RunPlan) -> dict[str, Any]:
    return plan.model_dump(mode="json")
