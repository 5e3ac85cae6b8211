"""`turnopd new env NAME | new teacher NAME`: scaffold a new env or teacher (turnopd/scaffold).

    turnopd new env twx        # envs/twx/, tests/envs/test_twx.py, recipes/twx/teacher_sft.yaml
    turnopd new teacher twx    # teachers/twx/teacher.yaml (and the SFT recipe when missing)

docs/adding-an-env.md walks through filling the pieces in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NEXT_STEPS = {
    "env": [
        "fill in the pieces that raise NotImplementedError in envs/{name}/ (spec.py, env.py, expert.py; "
        "prompt.py's wording) and PARSE_CASES in tests/envs/test_{name}.py",
        "pytest tests/envs/test_{name}.py        # fails until they are filled in",
        "turnopd env play {name} --split SPLIT    # play a task yourself",
        "turnopd env expert {name} --split SPLIT  # the expert's success per task type",
        "turnopd new teacher {name}; turnopd sft recipes/{name}/teacher_sft.yaml",
    ],
    "package": [
        "pip install -e {folder}               # registers env {name} (its entry point)",
        "turnopd env list                      # {name} is listed",
        "turnopd env expert {name} --split train",
        "then replace the game in {folder}/turnopd_{name}/__init__.py with yours",
    ],
    "teacher": [
        "turnopd sft recipes/{name}/teacher_sft.yaml   # trains the teacher and rewrites its spec",
        "or point `model` in teachers/{name}/teacher.yaml at your own model",
        "distillation recipes name it with  teachers: {{{name}: teachers/{name}/teacher.yaml}}",
    ],
}


def run(args: argparse.Namespace) -> int:
    from turnopd.orchestration.scaffold import ScaffoldError, new_env, new_env_package, new_teacher

    root = Path(args.root).resolve() if args.root else None
    package = getattr(args, "package", None)
    try:
        if package:
            result = new_env_package(args.name, Path(package))
        else:
            result = (new_env if args.kind == "env" else new_teacher)(args.name, root)
    except ScaffoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in result.created:
        print(f"created  {path}")
    for path in result.kept:
        print(f"kept     {path} (exists)")
    if args.kind == "env" and not package:
        if result.registered:
            print(f'updated  envs/__init__.py (BUILTIN_ENVS imports "envs.{args.name}")')
        else:
            print(f"to do    {result.register_line} (the scaffold could not rewrite that line)")
    print("\nnext steps (docs/adding-an-env.md):")
    for step in NEXT_STEPS["package" if package else args.kind]:
        print(f"  {step.format(name=args.name, folder=package)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("new", help="scaffold a new env or teacher (files that fail their test until filled in)")
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, help_text in [("env", "an env package, its test and a teacher SFT recipe"),
                            ("teacher", "the teacher spec of an env (and its SFT recipe when missing)")]:
        p = kinds.add_parser(kind, help=help_text)
        p.add_argument("name", help="the env's name: a lower-case Python identifier")
        p.add_argument("--root", help="the checkout to write into (default: the one this turnopd runs from)")
        if kind == "env":
            p.add_argument("--package", metavar="DIR",
                           help="write an installable env package (a plugin) into DIR instead of the checkout")
        p.set_defaults(func=run)
