"""`rlflow train [CONFIG] [key=value ...] [--resume RUN_ID]`: the main job."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from engine.errors import ConfigError
from flows.commands.config import split_config_args

# Overrides that carry credentials become environment variables: never flow-run parameters.
_SECRET_OVERRIDES = {"storage.access_key_id": "AWS_ACCESS_KEY_ID",
                     "storage.secret_access_key": "AWS_SECRET_ACCESS_KEY"}
_SECRET_ON_COMMAND_LINE = ("storage.secret_access_key",)


def register(sub: argparse._SubParsersAction) -> None:
    for name, what, config, func in (("train", "train (or resume) a run: the main job", "tiny_grpo", _train),
                                     ("sft", "supervised fine-tuning: rlflow train with algorithm.objective=sft",
                                      "tiny_sft", _sft)):
        parser = sub.add_parser(name, help=what)
        parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]",
                            help=f"a YAML config (default configs/{config}.yaml) and dotted overrides")
        parser.add_argument("--resume", metavar="RUN_ID", help="go on with an existing run from its storage")
        parser.add_argument("--log-level", default=os.environ.get("RLFLOW_LOG_LEVEL", "INFO"),
                            help="INFO (default) or DEBUG for detail (also RLFLOW_LOG_LEVEL)")
        parser.set_defaults(func=func)


def _sft(args: argparse.Namespace) -> int:
    """`rlflow sft [CONFIG] [key=value ...]`: `rlflow train` of configs/tiny_sft.yaml (or CONFIG) with
    algorithm.objective=sft (a config of RL settings is refused, naming the first)."""
    from flows.config import SFT_CONFIG

    path, overrides = split_config_args(args.args)
    args.args = [path or str(SFT_CONFIG), *overrides, "algorithm.objective=sft"]
    return _train(args)


def strip_secrets(overrides: list[str]) -> list[str]:
    """Refuse a secret on the command line (any user of the machine reads /proc/<pid>/cmdline); move
    the access key id into this process's environment; return the rest."""
    kept = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() in _SECRET_ON_COMMAND_LINE:
            raise ConfigError(f"{key.strip()} on the command line: every user of this machine can read a command "
                              f"line (/proc/<pid>/cmdline); set {_SECRET_OVERRIDES[key.strip()]} in the environment, "
                              "or use an AWS credentials file (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE)")
        if key.strip() in _SECRET_OVERRIDES:
            os.environ[_SECRET_OVERRIDES[key.strip()]] = value
        else:
            kept.append(item)
    return kept


def _train(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.plan import new_run_id

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "httpcore", "urllib3", "botocore", "aiobotocore", "s3fs", "fsspec"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    path, overrides = split_config_args(args.args)
    overrides = strip_secrets(overrides)
    cfg = load_config(path, overrides)  # a bad config fails here, before anything starts
    if args.resume is None and cfg.trainer.run_id is None:
        overrides.append(f"trainer.run_id={new_run_id(cfg)}")
        cfg = load_config(path, overrides)
    run_id = args.resume or cfg.trainer.run_id
    # Every input is checked before the stack starts or anything is written (the flow checks again).
    from flows.plan import check_inputs, resolve_config
    from flows.progress import build_progress

    run_cfg, run_id = resolve_config(path, overrides, args.resume)
    with build_progress(sys.stdout.isatty()):  # model.path=tiny is built here on first use (minutes)
        check_inputs(run_cfg, run_id, resume=args.resume is not None)
    result = run_train(cfg, config_path=path, overrides=overrides, resume=args.resume, run_id=str(run_id))
    print(f"rlflow: run {result['run_id']} finished iteration {result['finished_iteration']}; "
          f"storage {result['storage']}" + (f"; export {result['export']}" if result.get("export") else ""))
    return 0


def run_train(cfg: Any, *, config_path: str | None, overrides: list[str], resume: str | None, run_id: str
              ) -> dict[str, Any]:
    """Start what is missing of the stack, connect, run the train flow with a progress display."""
    from flows import progress
    from flows.liveness import enable_heartbeats, ensure_crash_automation
    from infra.config import StackConfig
    from infra.stack import apply_connect_env, ensure_stack, ui_login

    with progress.phase("the local stack (Prefect server, Ray head)", sys.stdout.isatty()):
        info = ensure_stack(StackConfig(), cfg.ray)
    enable_heartbeats()
    apply_connect_env(info)
    ensure_crash_automation()
    print(f"rlflow: run {run_id}  |  Prefect UI {info.ui_url}{ui_login(info)}  |  Ray {info.ray_address}", flush=True)

    from flows.train import connect_ray, train

    connect_ray(info.ray_address, cfg)
    if logging.getLogger().level > logging.DEBUG:
        progress.quiet_console()  # Prefect's console then shows one line per iteration
    with progress.console_progress(cfg.trainer.total_iterations, sys.stdout.isatty()):
        return train(config_path=config_path, overrides=overrides, resume=resume, run_name=run_id)
