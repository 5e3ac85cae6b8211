"""`turnopd env list | play | expert | prompts`: the quickest way to see that an environment works.

    turnopd env list
    turnopd env play alfworld --split valid_unseen --task 3
    turnopd env expert alfworld --split valid_unseen --workers 2 options.expert=handcoded
    turnopd env prompts alfworld --split train -o first_turns.jsonl   # the prompts env's file format

Trailing KEY=VALUE arguments set the env block of a recipe (turnopd.config.EnvConfig), e.g.
max_turns=30 task_types=[pick_and_place_simple] options.expert=handcoded.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from envs.base import EnvSpec, PromptContext, recent_pairs, shows_screenshots


def _env_spec(args: argparse.Namespace) -> tuple[EnvSpec, Any]:
    from omegaconf import OmegaConf

    from envs import make_env_spec
    from turnopd.orchestration.recipe import load_env_config

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise ValueError(f"env settings must be KEY=VALUE, got {bad}")
    overrides = OmegaConf.from_dotlist([f"name={args.env}", *args.overrides])
    config = load_env_config(overrides)
    spec = make_env_spec(config, args.data_dir)
    if not any(o.startswith("max_turns=") for o in args.overrides):
        config.max_turns = spec.default_max_turns
    return spec, config


def _task(spec: EnvSpec, split: str, task: str) -> str:
    tasks = spec.tasks(split)
    if task.isdigit():
        if int(task) >= len(tasks):
            raise ValueError(f"--task {task}: split {split!r} has {len(tasks)} tasks (0..{len(tasks) - 1})")
        return tasks[int(task)]
    if task not in tasks:
        raise ValueError(f"--task {task!r} is neither an index nor a task id of split {split!r}")
    return task


def list_envs(args: argparse.Namespace) -> int:
    """Each registered env's splits and task counts; an env that cannot list its tasks here (no data,
    a required option, a plugin that failed to load) gets one row saying why, on the table."""
    from rich.console import Console
    from rich.table import Table

    from envs import ENVS, PLUGIN_ERRORS, make_env_spec
    from turnopd.config import EnvConfig

    table = Table(title="registered environments")
    for column in ("env", "split", "tasks", "task types", "max turns", "note"):
        table.add_column(column)
    for name in sorted({*ENVS.names(), *PLUGIN_ERRORS}):
        try:
            spec = make_env_spec(EnvConfig(name=name), args.data_dir)
            for split in spec.splits():
                tasks = spec.tasks(split)
                table.add_row(name, split, str(len(tasks)), str(len({spec.task_type(t) for t in tasks})),
                              str(spec.default_max_turns), "")
        except Exception as exc:  # one env without its data must not hide the others
            table.add_row(name, "-", "-", "-", "-", f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    Console().print(table)
    return 0


def play(args: argparse.Namespace) -> int:
    """A person plays one task: observation and admissible actions shown, one command per line."""
    spec, config = _env_spec(args)
    task_id = _task(spec, args.split, args.task)
    env = spec.make()
    outcome = env.reset(task_id)
    goal = outcome.info.get("task", "")
    print(f"{spec.name} {args.split} task {task_id} ({spec.task_type(task_id)}); "
          f"type a command, a number from the list, or 'quit'")
    history: list[tuple[str, str]] = []
    step = 0
    try:
        while not outcome.done and step < config.max_turns:
            if args.show_prompt:
                ctx = PromptContext(task=goal, step=step, observation=outcome.observation,
                                    history=recent_pairs(history, config.history_length),
                                    admissible=outcome.admissible, answer_format=config.answer_format)
                print(f"\n--- prompt ---\n{spec.render_prompt(ctx)}\n--------------")
            print(f"\n[step {step}] {outcome.observation}")
            if "screenshot" in outcome.info:  # an env that shows pages as images: what the agent sees
                print(f"(the page as the agent sees it: {save_screenshot(spec, outcome, args.screens / f'step{step}.png')})")
            if outcome.admissible:
                print("\n".join(f"  {i:2d}. {a}" for i, a in enumerate(outcome.admissible)))
            try:
                line = input("> ").strip()
            except EOFError:
                break
            if line == "quit":
                break
            if line.isdigit() and outcome.admissible and int(line) < len(outcome.admissible):
                line = outcome.admissible[int(line)]
            action = spec.parse_action(f"<action>{line}</action>").action
            history.append((outcome.observation, action))
            outcome = env.step(action)
            step += 1
            if outcome.info.get("invalid"):
                print("(the env did not accept that command)")
    finally:
        env.close()
        if shows_screenshots(spec):
            spec.pixel_store.clear()
    print(f"\n{outcome.observation}\nend after {step} steps: won={outcome.won} reward={outcome.reward:g}"
          f"{'' if outcome.done else ' (not finished)'}")
    return 0


def save_screenshot(spec: EnvSpec, outcome: Any, path: Path) -> Path:
    """The outcome's screenshot, fetched from the spec's pixel store, saved as a PNG."""
    from PIL import Image

    key = outcome.info["screenshot"]
    pixels = spec.pixel_store.get([key])[key]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def expert(args: argparse.Namespace) -> int:
    """The env's expert plays N tasks of a split through the env pool."""
    from rich.console import Console
    from rich.table import Table

    from envs.demonstrations import play_experts
    from envs.pool import EnvPool
    from turnopd.core.progress import progress_bar

    spec, config = _env_spec(args)
    tasks = spec.tasks(args.split)[: args.n]
    workers = args.workers or config.num_workers
    won: dict[str, list[bool]] = defaultdict(list)
    turns: dict[str, list[int]] = defaultdict(list)
    start = time.perf_counter()
    progress = progress_bar(f"{spec.name} expert", "won {task.fields[won]}")
    with progress, EnvPool.for_config(spec, dataclasses.replace(config, num_workers=workers)) as pool:
        bar = progress.add_task("episodes", total=len(tasks), won=0)
        for demo in play_experts(spec, pool, tasks, config.max_turns):
            won[demo.task_type].append(demo.won)
            turns[demo.task_type].append(len(demo.steps))
            progress.update(bar, advance=1, won=sum(map(sum, won.values())))
        restarts = pool.restarts
    elapsed = time.perf_counter() - start

    options = f" (options {config.options})" if config.options else ""
    table = Table(title=f"{spec.name} expert{options} on {args.split}, max {config.max_turns} turns")
    for column in ("task type", "episodes", "success", "mean turns"):
        table.add_column(column, justify="right" if column != "task type" else "left")
    rows = sorted(won) + ["all"]
    for kind in rows:
        w = won[kind] if kind != "all" else [x for v in won.values() for x in v]
        t = turns[kind] if kind != "all" else [x for v in turns.values() for x in v]
        table.add_row(kind, str(len(w)), f"{100 * sum(w) / max(len(w), 1):.1f}%", f"{sum(t) / max(len(t), 1):.1f}")
    console = Console()
    console.print(table)
    played = sum(len(v) for v in won.values())
    console.print(f"{played}/{len(tasks)} episodes played ({len(tasks) - played} failed by the env, "
                  f"{restarts} worker restarts) in {elapsed:.0f} s with {workers} workers"
                  + (f", {config.step_latency_s:g} s simulated latency a request" if config.step_latency_s else ""))
    return 0


def prompts(args: argparse.Namespace) -> int:
    """Each task's first-turn prompt, as the student sees it, written as the prompts env's JSONL
    (envs/prompts): one-turn distillation on an agent's openings, or a prompt trainer's dataset; with
    --expert-answers, the expert's first action as each prompt's answer."""
    from envs.prompts.spec import first_turn_rows, write_rows

    spec, config = _env_spec(args)
    count = write_rows(first_turn_rows(spec, config.answer_format, args.split, args.n, args.expert_answers),
                       args.output)
    print(f"{count} first-turn prompts of {spec.name} {args.split} -> {args.output}")
    return 0


def _reporting_errors(command: Any) -> Any:
    """Bad input (unknown env, split, task or setting; missing data) is one line on stderr, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("env", help="list, play or run the expert of an environment, or export its prompts")
    env_sub = parser.add_subparsers(dest="env_command", metavar="ENV_COMMAND", required=True)

    def add_common(p: argparse.ArgumentParser) -> None:
        p.add_argument("env", help="a registered env (see `turnopd env list`)")
        p.add_argument("--split", required=True, help="the split to draw tasks from")
        p.add_argument("--data-dir", help="data root holding the env's data (else $TURNOPD_DATA, ../shared/data)")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="env settings, as in a recipe's env block (e.g. options.expert=handcoded)")

    p = env_sub.add_parser("list", help="registered environments, their splits and task counts")
    p.add_argument("--data-dir", help="data root (else $TURNOPD_DATA, ../shared/data)")
    p.set_defaults(func=_reporting_errors(list_envs))

    p = env_sub.add_parser("play", help="play one task yourself in the terminal")
    add_common(p)
    p.add_argument("--task", default="0", help="task index in the split, or a task id")
    p.add_argument("--show-prompt", action="store_true", help="print the prompt the model would see")
    p.add_argument("--screens", type=Path, default=Path("screens"),
                   help="where an env that shows pages as images saves each page as a PNG (default ./screens)")
    p.set_defaults(func=_reporting_errors(play))

    p = env_sub.add_parser("expert", help="run the env's expert; print success rate and mean turns")
    add_common(p)
    p.add_argument("--n", type=int, default=None, help="first N tasks of the split (default: all)")
    p.add_argument("--workers", type=int, default=None, help="env worker processes (default: env.num_workers)")
    p.set_defaults(func=_reporting_errors(expert))

    p = env_sub.add_parser("prompts", help="write each task's first-turn prompt as the prompts env's JSONL")
    add_common(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--n", type=int, default=None, help="first N tasks of the split (default: all)")
    p.add_argument("--expert-answers", action="store_true",
                   help="give each prompt the env expert's first action as its answer (won when the student agrees)")
    p.set_defaults(func=_reporting_errors(prompts))
