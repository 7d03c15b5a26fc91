"""Train one short GRPO run per model family in ONE process (what `rlflow train` does for each), so the
parametrized family test pays Python's and the libraries' start-up once: `python families_probe.py OUT
ROOT name=model_dir ...` writes {family: result} to OUT as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def overrides(model: str, root: str, run_id: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", "data.task=sort",
            "trainer.total_iterations=2", "trainer.save_every=2", "trainer.val_every=2", "trainer.world_size=2",
            "data.train_size=64", "data.val_size=8", "data.train_batch_size=4", "rollout.n=4",
            "rollout.max_new_tokens=16", "data.max_prompt_length=128", "actor.mini_batch_size=16",
            "actor.micro_batch_size=16", "actor.lr=1e-3", "rollout.val_do_sample=false",
            f"reward.function={REPO / 'tests' / 'pipeline' / 'rewards.py'}:digit_share"]  # varies in every group


def main() -> int:
    out, root, pairs = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
    import time

    from flows.commands.train import run_train
    from flows.config import load_config
    from flows.plan import check_inputs

    results = {}
    for family, model in pairs:
        start = time.perf_counter()
        args = overrides(model, root, f"family-{family}")
        cfg = load_config(None, args)
        check_inputs(cfg, cfg.trainer.run_id, resume=False)
        results[family] = run_train(cfg, config_path=None, overrides=args, resume=None, run_id=cfg.trainer.run_id)
        print(f"{family}: {time.perf_counter() - start:.1f} s {results[family]}", flush=True)
    Path(out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
