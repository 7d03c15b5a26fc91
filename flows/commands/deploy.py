"""`rlflow deploy CONFIG --cron EXPR | --interval S` and `rlflow serve`: recurring runs (flows/deploy.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from engine.errors import ConfigError
from flows.commands.config import split_config_args


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("deploy", help="create (or update) a recurring run: a Prefect deployment")
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]",
                        help="a YAML config (default configs/tiny_grpo.yaml) and dotted overrides")
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar="EXPR", help='a cron schedule, for example "0 2 * * *"')
    when.add_argument("--interval", type=float, metavar="SECONDS", help="a run every SECONDS")
    parser.add_argument("--pool", metavar="NAME",
                        help="deploy to this Prefect work pool (process type, created if absent): `prefect worker "
                        "start --pool NAME` on a machine with rlflow installed executes the runs, instead of "
                        "`rlflow serve`")
    parser.add_argument("--timezone", help="of the cron schedule (default UTC), for example Europe/Berlin")
    parser.add_argument("--name", help="the deployment and lineage (default: trainer.run_id, else trainer.project)")
    parser.add_argument("--mode", choices=("continue", "fresh"), default=None,
                        help="continue: every run resumes the lineage's run for trainer.iterations_per_run "
                             "iterations; fresh: a new run each time (from --base-checkpoint)")
    parser.add_argument("--base-checkpoint", metavar="RUN[:STEP]|URL",
                        help="the committed checkpoint a new run starts from: RUN (its latest), RUN:STEP under "
                             "storage.root, or <root>/<run>/checkpoints/step_NNNNNN")
    parser.add_argument("--then", metavar="RL_CONFIG", dest="then_config",
                        help="a post-training pipeline (mode chain): each run is an SFT run of CONFIG on its data as "
                             "it is then, from the lineage's last RL checkpoint, then an RL run of RL_CONFIG from the "
                             "SFT run's checkpoint")
    parser.add_argument("--then-set", metavar="KEY=VALUE", action="append", default=[], dest="then_overrides",
                        help="an override of --then's config (repeat it for more)")
    parser.add_argument("--collision", choices=("enqueue", "cancel-new"), default="enqueue",
                        help="a run that comes due while the previous one runs: waits (default) or is cancelled")
    parser.set_defaults(func=_deploy)

    serve = sub.add_parser("serve", help="execute the runs of the deployments (a long-running process)")
    serve.add_argument("names", nargs="*", metavar="NAME", help="deployments to serve (default: all of rlflow's)")
    serve.add_argument("--limit", type=int, help="runs of different deployments at once (default: no limit)")
    serve.set_defaults(func=_serve)


def _deploy(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.deploy import FLOW_NAME, DeploySpec, check_spec, deploy, refuse_stored_secrets
    from infra.config import StackConfig
    from infra.stack import apply_connect_env, ensure_stack

    path, overrides = split_config_args(args.args)
    refuse_stored_secrets([*overrides, *args.then_overrides])
    cfg = load_config(path, overrides)
    chain = args.then_config is not None
    if args.then_overrides and not chain:
        raise ConfigError("--then-set overrides --then's config: give --then RL_CONFIG")
    if chain and args.mode is not None:
        raise ConfigError(f"--mode {args.mode} with --then: a chain's runs are new each night (SFT, then RL)")
    then_overrides = args.then_overrides
    if chain:
        then_overrides = _absolute_root(then_overrides, load_config(args.then_config, then_overrides).storage.root)
    spec = DeploySpec(
        name=args.name or cfg.trainer.run_id or cfg.trainer.project,
        config_path=str(Path(path).resolve()) if path else None,  # the served run may start elsewhere
        overrides=_absolute_root(overrides, cfg.storage.root), mode="chain" if chain else (args.mode or "continue"),
        base_checkpoint=args.base_checkpoint, cron=args.cron, interval_s=args.interval, timezone=args.timezone,
        collision=args.collision, pool=args.pool,
        then_config_path=str(Path(args.then_config).resolve()) if chain else None, then_overrides=then_overrides)
    check_spec(spec)  # before the stack starts
    info = ensure_stack(StackConfig(), cfg.ray)
    apply_connect_env(info)
    deployment_id = deploy(spec)
    when = f"cron {args.cron!r}" + (f" ({args.timezone})" if args.timezone else "") if args.cron \
        else f"every {args.interval:g} s"
    print(f"rlflow: deployment {FLOW_NAME}/{spec.name} ({deployment_id}), {when}, mode {spec.mode}, "
          f"one run at a time ({spec.collision})\n"
          + (f"rlflow: `prefect worker start --pool {spec.pool}` executes its runs, where rlflow is installed and the "
             "stack's address is in the environment (`eval \"$(rlflow status --env)\"`)"
             if spec.pool else "rlflow: `rlflow serve` executes its runs")
          + f"; Prefect UI {info.ui_url}/deployments/deployment/{deployment_id}")
    return 0


def _absolute_root(overrides: list[str], root: str) -> list[str]:
    """A relative local storage.root, made absolute here: the served run may start in another folder."""
    if "://" in root or Path(root).is_absolute():
        return overrides
    kept = [o for o in overrides if o.partition("=")[0].strip() != "storage.root"]
    return [*kept, f"storage.root={Path(root).resolve()}"]


def _serve(args: argparse.Namespace) -> int:
    from flows.deploy import serve_deployments
    from infra.config import StackConfig
    from infra.stack import apply_connect_env, ensure_stack, ui_login

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from flows.liveness import enable_heartbeats, ensure_crash_automation

    info = ensure_stack(StackConfig())
    enable_heartbeats()  # the runs (subprocesses) inherit it, with the stack's address and the Ray token path
    apply_connect_env(info)
    ensure_crash_automation()
    print(f"rlflow: Prefect UI {info.ui_url}{ui_login(info)}  |  Ray {info.ray_address}", flush=True)
    serve_deployments(args.names or None, limit=args.limit)
    return 0
