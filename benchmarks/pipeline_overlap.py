"""Pipeline overlap: the same OPD recipe and seeds in pipeline.mode sync, one_step_off and pool, side
by side in one run, on real ALFWorld games.

    python benchmarks/pipeline_overlap.py                          # tiny random teacher and student
    python benchmarks/pipeline_overlap.py --teacher teachers/alfworld/teacher.yaml --steps 12
    python benchmarks/pipeline_overlap.py --modes sync pool --seeds 0 1 --sync-threads 1 2
    python benchmarks/pipeline_overlap.py --env webshop_screenshot    # AsyncWebRL's setting: a VLM on screenshots
    python benchmarks/pipeline_overlap.py --table benchmarks/results/pipeline_overlap_screenshots.json   # a saved run's table

Every run is `turnopd distill` in its own process, one after another, on a recipe this script writes
(TurnOPD: adaptive depth with probes, progressive loss; k1 with clip_eps 0.2 in every mode so that the
objective is the same). Every mode gets the whole machine: one_step_off and pool run with
OMP_NUM_THREADS = --threads, which the pipeline splits between its two processes (1 + 1 on 2 cores);
sync runs once per --sync-threads value (default --threads), since on a loaded machine fewer threads
in one process can be faster than more. The speedup is over the fastest sync run. Without --teacher the teacher and student are tiny random-init models (a
tokenizer built from ALFWorld's text; the student is --hidden wide and --layers deep so that training
costs about as much as generation): their accuracy stays at zero, so only the clocks mean anything.
With --teacher (a teacher.yaml, e.g. the one `turnopd sft recipes/alfworld/teacher_sft.yaml` writes)
the student shares its tokenizer and the frontier compares accuracy too.

`--env webshop_screenshot` (docs/results/screenshot-throughput-design.md): the student is a random-init
tiny VLM of the screenshot recipe's shape (turnopd.models.vlm: text hidden 128 x 3 layers, SigLIP tower
hidden 128, 576 image tokens a screen) reading each turn's screenshot through the pixel store, the
teacher a random-init tiny text model on its tokenizer scoring the page's text (as
recipes/webshop/screenshot.yaml's does); saved to pipeline_overlap_screenshots.json.

Reported per mode, from metrics.jsonl (steps after the first, whose clock includes the generator's
start-up): wall-clock per optimizer step (mean of step_time_s; eval and checkpoint excluded), the
trainer's idle fraction (1 - train phase / step time: everything the training process does besides
forward/backward/optimizer step, i.e. waiting for rollouts in sync mode and for the generator process
in the others), generated and trained tokens per second of step time, trajectories per second of step time, the idle
share of each resource (1 - its busy seconds / step time: generation, env, teacher, trainer), the
generator's idle fraction, the trajectories' staleness, and the speedup of the mean step time over
sync's. Then `turnopd
frontier --md` on the runs: Avg@k against the training wall-clock, Same-Step and Least-Time.
Figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from record import Summary, save_result

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "one_step_off", "pool")

RECIPE = """
name: bench
output_dir: {out}/runs
student:
  path: {out}/models/student-h{hidden}-l{layers}
  prepare: tiny
  prepare_options: {{tokenizer: {tokenizer}, hidden_size: {hidden}, num_layers: {layers}, num_heads: {heads},
                    max_position_embeddings: 2048, seed: 7}}
teachers: {{alfworld: {teacher}}}
env: {{name: alfworld, max_turns: {max_turns}, answer_format: action, history_length: 1, num_workers: 2,
       task_types: [pick_and_place_simple, look_at_obj_in_light], eval_split: valid_seen}}
policy: {{max_new_tokens: {new_tokens}, temperature: 1.0}}
objective: {{estimator: k1, clip_eps: 0.2}}
loss: {{mode: progressive}}
depth: {{mode: adaptive, warmup_steps: 2, probe_every: 4, num_probes: {episodes},
         min_successes: 1}}
trainer: {{steps: {steps}, episodes_per_step: {episodes}, lr: 1.0e-4}}
eval: {{every: {eval_every}, max_tasks: {eval_tasks}}}
checkpoint: {{every: 0, keep_last: 1}}
pipeline: {{max_staleness: 1}}
tracking: []
"""

SCREENSHOT_RECIPE = """
name: bench
output_dir: {out}/runs
student: {{path: {out}/models/vlm-student}}
teachers: {{webshop_screenshot: {teacher}}}
env: {{name: webshop_screenshot, max_turns: {max_turns}, answer_format: action, history_length: 1, num_workers: 2,
       eval_split: test, options: {{screenshot_window: 1}}}}
policy: {{backend: transformers, max_new_tokens: {new_tokens}, temperature: 1.0}}
objective: {{estimator: k1, clip_eps: 0.2}}
loss: {{mode: progressive}}
depth: {{mode: adaptive, warmup_steps: 2, probe_every: 4, num_probes: {episodes}, min_successes: 1}}
trainer: {{steps: {steps}, episodes_per_step: {episodes}, lr: 1.0e-4}}
eval: {{every: {eval_every}, max_tasks: {eval_tasks}}}
checkpoint: {{every: 0, keep_last: 1}}
pipeline: {{max_staleness: 1}}
tracking: []
"""
RESOURCES = ("generation", "env", "teacher", "trainer")


def prepare_models(out: Path, teacher_spec: str | None, hidden: int) -> tuple[str, str]:
    """(teacher spec path, tokenizer folder): the given teacher, or a tiny random one built here."""
    if teacher_spec:
        from teachers import load_teacher_spec

        return str(Path(teacher_spec).resolve()), load_teacher_spec(teacher_spec).model
    from turnopd.models import prepare_model

    # one folder per size, so a smoke run at another size does not stand in the way of this one
    teacher_dir = prepare_model("tiny", out / "models" / f"teacher-h{hidden}", env="alfworld", corpus_episodes=20,
                                hidden_size=hidden, num_layers=2, num_heads=max(1, hidden // 64),
                                max_position_embeddings=2048, seed=0)
    spec = out / "models" / "teacher.yaml"
    spec.write_text(f"name: tiny-random-teacher\nmodel: {teacher_dir}\nbackend: transformers\ndtype: float32\n"
                    "max_length: 2048\n")
    return str(spec), str(teacher_dir)


def prepare_screenshot_models(out: Path) -> str:
    """The teacher spec of a random-init text teacher on the tokenizer of a random-init tiny VLM student
    (out/models/vlm-student), both built here once."""
    from turnopd.models import vlm
    from turnopd.models.tiny import build_tiny_model

    models = out / "models"
    student, teacher = models / "vlm-student", models / "text-teacher"
    if not student.exists():
        texts = [page.text for page in vlm.play_pages("train", 20)]
        vlm.build_tiny_vlm(student, texts, seed=0, hidden_size=128, num_layers=3, num_heads=4,
                           max_position_embeddings=4096)
    if not teacher.exists():
        build_tiny_model(teacher, tokenizer=student, hidden_size=128, num_layers=2, num_heads=2,
                         max_position_embeddings=4096, seed=3)
    spec = models / "text-teacher.yaml"
    spec.write_text(f"name: tiny-random-text-teacher\nmodel: {teacher}\nbackend: transformers\ndtype: float32\n"
                    "max_length: 4096\n")
    return str(spec)


def run_mode(recipe: Path, label: str, mode: str, threads: int, seed: int) -> Path:
    name = f"{label}-s{seed}"
    run_dir = recipe.parent / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [sys.executable, "-m", "turnopd.cli", "distill", str(recipe), f"name={name}", f"seed={seed}",
               f"pipeline.mode={mode}"]
    print(f"$ OMP_NUM_THREADS={threads}", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return run_dir


def summarize(run_dir: Path) -> dict[str, float]:
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"][1:]  # the first step's clock includes start-up
    step_time = sum(r["step_time_s"] for r in train)
    asynchronous = any(r["generator_phases"] for r in train)
    return {
        "trajectories_s": sum(r["episodes"] for r in train) / step_time,
        **{f"idle_{resource}": 1 - sum(r["busy"].get(resource, 0.0) for r in train) / step_time
           for resource in RESOURCES},
        "step_s": step_time / len(train),
        "step_median_s": statistics.median(r["step_time_s"] for r in train),
        "trainer_idle": 1 - sum(r["phases"].get("train", 0.0) for r in train) / step_time,
        # the generator's own phases (startup, idle, weight_sync) leave out its answering time, so its
        # idle seconds are a share of the step time, as every resource's are
        "generator_idle": sum(r["generator_phases"].get("idle", 0.0) for r in train) / step_time
        if asynchronous else float("nan"),
        "generated_tok_s": sum(r["tokens_generated"] for r in train) / step_time,
        "trained_tok_s": sum(r["tokens_trained"] for r in train) / step_time,
        "staleness": statistics.mean(r["pipeline"]["staleness_mean"] for r in train),
        "dropped": sum(r["pipeline"]["dropped_stale"] for r in train),
        "screens_missing": sum((r.get("screenshots") or {}).get("missing", 0) for r in train),  # text envs: 0
    }


def speed_ups(samples: list[dict], label: str) -> list[float]:
    """Per seed, in seed order: the fastest sync run's step time of that seed over the label's; [] for
    a sync label or without a sync run."""
    if label.startswith("sync"):
        return []
    syncs = [s for s in samples if s["variant"].startswith("sync")]
    return [min(s["step_s"] for s in syncs if s["seed"] == mine["seed"]) / mine["step_s"]
            for mine in sorted((s for s in samples if s["variant"] == label), key=lambda s: s["seed"])
            if any(s["seed"] == mine["seed"] for s in syncs)]


def throughput_table(samples: list[dict]) -> str:
    """The design's table from a saved file's samples: per mode the median over seeds with the range
    of trajectories per second of step time, the speed-up over sync paired by seed, each resource's
    idle share, the generator's idle share, the mean staleness, the stale trajectories dropped and the
    screenshots a batch missed (steps 2 on, as everything here)."""
    def spread(values: list[float], fmt: str, unit: str = "", scale: float = 1.0) -> str:
        values = [scale * v for v in values]
        return f"{statistics.median(values):{fmt}}{unit} ({min(values):{fmt}}-{max(values):{fmt}})"

    lines = ["| mode | seeds | trajectories / s | speed-up over sync (paired by seed) | "
             + " | ".join(f"{r} idle" for r in RESOURCES) + " | generator idle | staleness | stale dropped | screenshots missing |",
             "| --- | ---: | ---: | ---: | " + "---: | " * len(RESOURCES) + "---: | ---: | ---: | ---: |"]
    for label in dict.fromkeys(s["variant"] for s in samples):
        mine = [s for s in samples if s["variant"] == label]
        ups = speed_ups(samples, label)
        generator = [s["generator_idle"] for s in mine if not math.isnan(s["generator_idle"])]
        lines.append(f"| {label} | {len(mine)} | {spread([s['trajectories_s'] for s in mine], '.3f')} | "
                     f"{spread(ups, '.2f', 'x') if ups else '-'} | "
                     + " | ".join(spread([s[f'idle_{r}'] for s in mine], '.0f', '%', 100) for r in RESOURCES)
                     + f" | {spread(generator, '.0f', '%', 100) if generator else '-'} | "
                     f"{spread([s['staleness'] for s in mine], '.2f')} | {sum(s['dropped'] for s in mine):.0f} | "
                     f"{sum(s['screens_missing'] for s in mine)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the repeats (interleaved)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every run (OMP_NUM_THREADS)")
    parser.add_argument("--sync-threads", nargs="+", type=int, help="one sync run per value (default: --threads)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per step (and probes per probe step)")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16, help="policy.max_new_tokens")
    parser.add_argument("--hidden", type=int, default=256, help="tiny student (and random teacher) width")
    parser.add_argument("--layers", type=int, default=4, help="tiny student depth")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-tasks", type=int, default=4)
    parser.add_argument("--teacher", help="a teacher.yaml (default: a tiny random teacher built here)")
    parser.add_argument("--env", choices=("alfworld", "webshop_screenshot"), default="alfworld",
                        help="webshop_screenshot: a tiny VLM student on screenshots (its own random models)")
    parser.add_argument("--table", type=Path, metavar="FILE", help="print the design's table of a saved result and stop")
    parser.add_argument("--out", type=Path, help="default: runs/bench-pipeline[-screenshots]")
    args = parser.parse_args()
    if args.table:
        print(throughput_table(json.loads(args.table.read_text())["samples"]))
        return

    shots = args.env == "webshop_screenshot"
    if shots and args.teacher:
        parser.error("--teacher is for ALFWorld; the screenshot runs build their own random models")
    out = (args.out or REPO / "runs" / ("bench-pipeline-screenshots" if shots else "bench-pipeline")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "recipe.yaml"
    sizes = dict(out=out, max_turns=args.max_turns, new_tokens=args.new_tokens, episodes=args.episodes,
                 steps=args.steps, eval_every=args.eval_every, eval_tasks=args.eval_tasks)
    if shots:
        recipe.write_text(SCREENSHOT_RECIPE.format(teacher=prepare_screenshot_models(out), **sizes))
    else:
        teacher, tokenizer = prepare_models(out, args.teacher, args.hidden)
        recipe.write_text(RECIPE.format(teacher=teacher, tokenizer=tokenizer, hidden=args.hidden, layers=args.layers,
                                        heads=max(1, args.hidden // 64), **sizes))
    print(f"recipe: {recipe}; {os.cpu_count()} CPUs", flush=True)

    variants = {}  # label -> (mode, threads)
    for mode in args.modes:
        for threads in (args.sync_threads or [args.threads]) if mode == "sync" else [args.threads]:
            variants[f"{mode}-t{threads}" if mode == "sync" else mode] = (mode, threads)
    runs = {(label, seed): run_mode(recipe, label, mode, threads, seed)
            for seed in args.seeds for label, (mode, threads) in variants.items()}
    rows = {label: [summarize(runs[label, seed]) for seed in args.seeds] for label in variants}
    mean = {label: {key: statistics.mean(r[key] for r in rows[label]) for key in rows[label][0]} for label in rows}
    # speedups against the fastest sync run (or the first run, without one)
    baseline = min((m["step_s"] for label, m in mean.items() if variants[label][0] == "sync"),
                   default=next(iter(mean.values()))["step_s"])

    env = "screenshot WebShop" if shots else "ALFWorld"
    print(f"\n**pipeline overlap: {args.steps} steps x {args.episodes} episodes, {env} max_turns "
          f"{args.max_turns}, seeds {args.seeds}; means over steps 2..{args.steps}**\n")
    print("| mode | threads | s / step | median | speedup vs sync | trajectories / s | trainer idle | generator idle | "
          "gen tok/s | trained tok/s | staleness | dropped | idle: " + ", ".join(RESOURCES) + " |")
    print("|---|" + "---:|" * 12)
    for label, m in mean.items():
        generator_idle = "–" if math.isnan(m["generator_idle"]) else f"{100 * m['generator_idle']:.0f}%"
        idle = ", ".join(f"{100 * m[f'idle_{r}']:.0f}%" for r in RESOURCES)
        print(f"| {label} | {variants[label][1]} | {m['step_s']:.2f} | {m['step_median_s']:.2f} | "
              f"{baseline / m['step_s']:.2f}x | {m['trajectories_s']:.3f} | {100 * m['trainer_idle']:.0f}% | "
              f"{generator_idle} | {m['generated_tok_s']:.1f} | {m['trained_tok_s']:.0f} | {m['staleness']:.2f} | "
              f"{m['dropped']:.0f} | {idle} |")
    print()
    samples = [{"variant": label, "seed": seed, **row} for label in variants
               for seed, row in zip(args.seeds, rows[label], strict=True)]
    paired = []
    for label in variants:
        paired.append(Summary.of(f"{label}: s per step", [r["step_s"] for r in rows[label]], "s"))
        paired.append(Summary.of(f"{label}: trajectories per second", [r["trajectories_s"] for r in rows[label]], "/s"))
        if ups := speed_ups(samples, label):
            paired.append(Summary.of(f"{label} speed-up over sync", ups, "x"))
    save_result("pipeline_overlap_screenshots" if shots else "pipeline_overlap",
                f"asynchronous pipeline vs sync ({args.steps} steps x {args.episodes} episodes, "
                f"{env} max_turns {args.max_turns}, {'given teacher' if args.teacher else 'tiny random models'}; "
                f"repeats = seeds {args.seeds})", paired, samples)
    first = next(iter(runs.values())).name  # a sync run's, when there is one
    frontier = subprocess.run([sys.executable, "-m", "turnopd.cli", "frontier", "--md", "--baseline", first,
                               *map(str, runs.values())], cwd=REPO, text=True, capture_output=True)
    print(frontier.stdout or frontier.stderr)


if __name__ == "__main__":
    main()
