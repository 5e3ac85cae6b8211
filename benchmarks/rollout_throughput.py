"""Rollout and teacher-scoring throughput, side by side in one run:

    python benchmarks/rollout_throughput.py --engines-only   # 1. only, every backend installed (vLLM venv: both)
    OMP_NUM_THREADS=1 python benchmarks/rollout_throughput.py --skip-engines  # 2. and 3. (vLLM venv), SmolLM2-135M
    python benchmarks/rollout_throughput.py --model tiny --skip-engines     # a tiny random model, seconds

1. The asynchronous agent loop against the lock-step engine it replaced (tests/rollout/lockstep.py),
   on the quickstart's batch: its student, env settings, sampling and depth cap (recipes/quickstart.yaml),
   `--episodes` train tasks in batches of trainer.episodes_per_step. The same episodes in every
   mode (each request carries its own seed): lock-step batches (today's sync mode before this
   engine), asynchronous batches (the sync mode now: a batch still ends with its longest episode),
   and an asynchronous stream through episodes_per_step slots (the pool pipeline: a finished
   episode's slot starts the next one at once). Reported: episode-turns/s, generation calls and rows
   per call, the wall-clock of each batch (every quickstart batch has a straggler that loops to the
   cap); median and range over `--repeats` repeats, the modes interleaved.
2. Student rollouts on real ALFWorld games (valid_unseen, the real env pool with 2 workers) with the
   transformers and the vLLM policy backends on the same model (fp32), at batch 1, 8 and 32
   episodes for `--turns` turns: generated tokens/s (over generation time) and env steps/s (over the
   whole rollout wall-clock), and the vLLM / transformers ratios.
3. Teacher scoring, transformers and vLLM teachers: the same append-only multi-turn trajectories
   (ALFWorld expert episodes as a growing chat) scored in ONE pass per trajectory vs one sequence per
   turn (each turn's prompt + answer, batched, as for history-window prompts); teacher tokens/s
   (tokens run through the model / time) and action tokens scored per second.

Every section runs `--repeats` repeats (3 by default) with its configurations interleaved and writes
its summary rows (median, range) to benchmarks/results/<section>.json (benchmarks/record.py);
section 2's name carries OMP_NUM_THREADS (rollout_backends_omp1.json): vLLM's CPU worker binds its
own threads whatever it says, the transformers backend runs on that many, so the ratio depends on it.
Sections 2 and 3 run each repeat in a process of its own (loading, warming up, measuring): repeats in
one process agree to within 2% while fresh processes differ by up to 15% (where vLLM's worker lands
its threads and memory), so only a range over processes says what a re-run will see.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from record import MIN_REPEATS, Summary, save_result  # noqa: E402

from envs import make_env_spec  # noqa: E402
from envs.base import PromptContext, format_answer  # noqa: E402
from envs.pool import EnvPool  # noqa: E402
from teachers import TeacherSpec, make_teacher, score_trajectories  # noqa: E402
from turnopd.config import EnvConfig, PolicyConfig  # noqa: E402
from turnopd.core.ledger import Ledger  # noqa: E402
from turnopd.core.types import Trajectory, Turn, trajectory_sequences  # noqa: E402
from turnopd.rollout import SamplingParams, make_policy  # noqa: E402
from turnopd.rollout.agent_loop import SlotPool, play_episode, rollout  # noqa: E402
from turnopd.rollout.render import chat_prompt_ids  # noqa: E402

MAX_MODEL_LEN = 4096
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the lock-step reference lives in tests/


def resolve_model(name: str) -> Path:
    from turnopd.models import prepare_model

    if name == "tiny":
        from turnopd.models.tiny import build_tiny_model

        corpus = ["You are in the middle of a room. Looking quickly around you, you see a cabinet 1.",
                  "Your task is to: put a clean mug in coffeemachine.", "<action>go to countertop 1</action>"]
        return build_tiny_model(Path("/tmp/turnopd-bench-tiny"), corpus * 4, hidden_size=64, num_heads=2,
                                max_position_embeddings=MAX_MODEL_LEN)
    if Path(name).is_dir():
        return Path(name)
    return prepare_model(name)  # cached after the first time


def bench_engines(recipe: Path, backends: list[str], episodes: int, repeats: int) -> list[dict]:
    """Section 1: one row per (repeat, backend, mode)."""
    from tests.rollout.lockstep import lockstep_rollout
    from turnopd.orchestration.pipeline.plan import sample_tasks, step_sampling
    from turnopd.orchestration.preflight import check_setup
    from turnopd.orchestration.recipe import load_recipe

    cfg = load_recipe(recipe)
    setup, _ = check_setup(cfg)
    per_batch = cfg.trainer.episodes_per_step
    # batch b: episodes_per_step tasks and the sampling of training step b, as the loop draws them
    batches = [(sample_tasks(setup.train_tasks, per_batch, cfg.seed, b, 0), step_sampling(cfg, b))
               for b in range(episodes // per_batch)]
    cap = cfg.env.max_turns

    batch_walls: list[float] = []  # the batched modes' batches, in the last play

    def batched(engine, spec, pool, policy):
        trajs = []
        for tasks, sampling in batches:
            start = time.perf_counter()
            trajs += engine(spec, pool, policy, tasks, env_config=cfg.env, sampling=sampling)
            batch_walls.append(time.perf_counter() - start)
        return trajs

    async def streamed(spec, pool, policy):
        slots = SlotPool(per_batch)

        async def one(task, episode, sampling):
            async with slots.slot() as slot:
                return await play_episode(spec, pool, policy, task, slot=slot, episode=episode, env_config=cfg.env,
                                          sampling=sampling, turn_limit=cap)
        return list(await asyncio.gather(*(one(task, i, sampling) for tasks, sampling in batches
                                           for i, task in enumerate(tasks))))

    modes = {"lock-step batches": lambda *a: batched(functools.partial(lockstep_rollout, cap=cap), *a),
             "async batches": lambda *a: batched(rollout, *a),
             "async stream": lambda *a: asyncio.run(streamed(*a))}
    rows = []
    with EnvPool.for_config(setup.spec, cfg.env) as pool:
        for backend in backends:
            policy = make_policy(dataclasses.replace(cfg.policy, backend=backend), str(setup.student_path),
                                 dtype="float32", seed=cfg.seed)
            batched(rollout, setup.spec, pool, policy)  # warm-up: loads every game once (cached after)
            for repeat in range(repeats):
                for mode, play in modes.items():
                    calls = len(getattr(getattr(policy, "_batcher", None), "batch_sizes", []))
                    batch_walls.clear()
                    start = time.perf_counter()
                    trajs = play(setup.spec, pool, policy)
                    wall = time.perf_counter() - start
                    sizes = getattr(getattr(policy, "_batcher", None), "batch_sizes", [])[calls:]
                    turns = sum(t.depth for t in trajs)
                    rows.append({"backend": backend, "mode": mode, "repeat": repeat, "episodes": len(trajs),
                                 "episode_turns": turns, "wall_s": wall, "episode_turns_per_s": turns / wall,
                                 "generation_calls": len(sizes), "rows_per_call": turns / len(sizes) if sizes else None,
                                 "batch_walls_s": list(batch_walls), "depths": [t.depth for t in trajs]})
                    print(f"[{backend} repeat {repeat + 1}/{repeats}] {mode}: {turns} episode-turns in {wall:.1f} s "
                          f"({turns / wall:.1f}/s)", flush=True)
            policy.close()
    return rows


def engine_report(rows: list[dict]) -> str:
    lines = ["| backend | engine | episode-turns/s (median, range) | vs lock-step (median of paired ratios) | "
             "generation calls | rows per call | a batch's wall-clock (median) |", "|---|---|---|---|---|---|---|"]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        base = {r["repeat"]: r["episode_turns_per_s"] for r in mine if r["mode"] == "lock-step batches"}
        for mode in dict.fromkeys(r["mode"] for r in mine):
            rs = [r for r in mine if r["mode"] == mode]
            rates = [r["episode_turns_per_s"] for r in rs]
            ratios = [r["episode_turns_per_s"] / base[r["repeat"]] for r in rs]
            calls = statistics.median(r["generation_calls"] for r in rs)
            per_call = statistics.median(r["rows_per_call"] for r in rs) if rs[0]["rows_per_call"] else None
            walls = [w for r in rs for w in r["batch_walls_s"]]
            batch_wall = f"{statistics.median(walls):.1f} s" if walls else "(no batches)"
            lines.append(f"| {backend} | {mode} | {statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                         f"{f'{calls:.0f}' if calls else '– (continuous)'} | {'–' if per_call is None else f'{per_call:.1f}'} | "
                         f"{batch_wall} |")
    return "\n".join(lines)


def bench_rollouts(model_dir: Path, backends: list[str], batch_sizes: list[int], turns: int,
                   max_new_tokens: int, repeats: int) -> list[dict]:
    """Section 2: one row per (repeat, batch size, backend); the backends interleaved within a repeat,
    every one playing the same episodes with the same sampling seed."""
    env_config = EnvConfig(name="alfworld", max_turns=50, history_length=2, num_workers=2)
    spec = make_env_spec(env_config)
    tasks = spec.tasks("valid_unseen")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    rows = []
    with EnvPool(spec, num_workers=env_config.num_workers, step_timeout_s=300) as pool:
        policies = {backend: make_policy(PolicyConfig(backend=backend, max_batch_size=32, options={
            "max_model_len": MAX_MODEL_LEN} if backend == "vllm" else {}), model_dir, dtype="float32")
            for backend in backends}
        for backend, policy in policies.items():  # warm-up: the first calls compile and allocate; vLLM's
            # CPU worker does so again at each new batch size (its first batch of 32 ran at 0.3-0.4x of the
            # next ones), a cost a run pays once, so it is paid here before any timing
            for batch in batch_sizes if backend == "vllm" else [2]:
                rollout(spec, pool, policy, tasks[:batch], env_config=env_config, sampling=sampling,
                        turn_limits=[1] * batch)
        for repeat in range(repeats):
            for batch in batch_sizes:
                for backend, policy in policies.items():
                    ledger = Ledger()
                    start = time.perf_counter()
                    trajs = rollout(spec, pool, policy, tasks[:batch], env_config=env_config, sampling=sampling,
                                    turn_limits=[turns] * len(tasks[:batch]), ledger=ledger)
                    wall = time.perf_counter() - start
                    tokens = sum(t.num_action_tokens for t in trajs)
                    steps = sum(t.depth for t in trajs)
                    busy = ledger.busy_totals  # waiting for generation / for the env, overlapping
                    rows.append({"repeat": repeat, "backend": backend, "batch": batch, "generated_tokens": tokens,
                                 "env_steps": steps, "generation_s": busy["generation"], "env_s": busy["env"],
                                 "wall_s": wall, "gen_tokens_per_s": tokens / busy["generation"],
                                 "env_steps_per_s": steps / wall})
                    print(json.dumps(rows[-1]), flush=True)
        for policy in policies.values():
            policy.close()
    return rows


def rollout_summaries(rows: list[dict]) -> list[Summary]:
    """Per batch size: each backend's generated tokens/s, and vLLM / transformers paired per repeat."""
    out = []
    by = {(r["repeat"], r["backend"], r["batch"]): r for r in rows}
    for batch in sorted({r["batch"] for r in rows}):
        for backend in dict.fromkeys(r["backend"] for r in rows):
            out.append(Summary.of(f"{backend}, batch {batch}: generated tok/s",
                                  [r["gen_tokens_per_s"] for r in rows if (r["backend"], r["batch"]) == (backend, batch)],
                                  "tok/s"))
        pairs = [(by[(k, "vllm", batch)], by[(k, "transformers", batch)]) for k in sorted({r["repeat"] for r in rows})
                 if (k, "vllm", batch) in by and (k, "transformers", batch) in by]
        if pairs:
            out.append(Summary.of(f"vLLM / transformers, batch {batch}: generated tok/s",
                                  [v["gen_tokens_per_s"] / t["gen_tokens_per_s"] for v, t in pairs], "x"))
            out.append(Summary.of(f"vLLM / transformers, batch {batch}: env steps/s of the whole rollout",
                                  [v["env_steps_per_s"] / t["env_steps_per_s"] for v, t in pairs], "x"))
    return out


def expert_chats(model_dir: Path, n: int, max_turns: int) -> list[Trajectory]:
    """ALFWorld expert episodes as append-only chats: turn t's prompt = turn t-1's prompt + answer +
    the next observation as a user message (built by concatenating token pieces, so it appends)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    env_config = EnvConfig(name="alfworld", history_length=0, answer_format="action")
    spec = make_env_spec(env_config)
    env = spec.make()
    trajs = []
    for task_id in spec.tasks("valid_unseen")[:n]:
        outcome = env.reset(task_id)
        expert = spec.expert(task_id)
        first = spec.render_prompt(PromptContext(task=outcome.info["task"], step=0, observation=outcome.observation,
                                                 history=[], admissible=outcome.admissible, answer_format="action"))
        prompt = chat_prompt_ids(tok, first)
        turns = []
        for t in range(max_turns):
            action = expert.act(outcome)
            answer = tok(format_answer(action, "action") + tok.eos_token, add_special_tokens=False)["input_ids"]
            turns.append(Turn(t, outcome.observation, list(prompt), answer, [0.0] * len(answer)))
            outcome = env.step(action)
            if outcome.done:
                break
            follow = chat_prompt_ids(tok, outcome.observation)
            prompt = prompt + answer + tok("\n", add_special_tokens=False)["input_ids"] + follow
        trajs.append(Trajectory(task_id, "alfworld", turns))
    env.close()
    return trajs


def per_turn_copies(trajs: list[Trajectory]) -> list[Trajectory]:
    """The same turns, each scored on its own prompt + answer (one sequence per turn)."""
    out = []
    for traj in trajs:
        for turn in traj.turns:
            alone = Turn(0, turn.observation, turn.prompt_ids, turn.action_ids, turn.student_logprobs)
            out.append(Trajectory(traj.task_id, traj.env_name, [alone]))
    return out


def bench_teachers(model_dir: Path, backends: list[str], n: int, max_turns: int, repeats: int) -> list[dict]:
    """Section 3: one row per (repeat, backend, mode), the modes interleaved within a repeat."""
    trajs = expert_chats(model_dir, n, max_turns)
    assert all(len(trajectory_sequences(t)) == 1 for t in trajs), "expert chats must append"
    action_tokens = sum(t.num_action_tokens for t in trajs)
    rows = []
    for backend in backends:
        teacher = make_teacher(TeacherSpec(name="bench", model=str(model_dir), backend=backend, dtype="float32",
                                           max_length=MAX_MODEL_LEN))
        score_trajectories({"alfworld": teacher}, per_turn_copies(trajs[:1]))  # warm-up
        for repeat in range(repeats):
            for mode, batch in (("one_pass", trajs), ("per_turn", per_turn_copies(trajs))):
                start = time.perf_counter()
                scored = score_trajectories({"alfworld": teacher}, batch)
                seconds = time.perf_counter() - start
                rows.append({"repeat": repeat, "backend": backend, "mode": mode, "trajectories": len(trajs),
                             "turns": sum(t.depth for t in trajs), "tokens_scored": scored,
                             "action_tokens": action_tokens, "seconds": seconds,
                             "teacher_tokens_per_s": scored / seconds, "action_tokens_per_s": action_tokens / seconds})
                print(json.dumps(rows[-1]), flush=True)
        teacher.close()
        del teacher
    return rows


def teacher_summaries(rows: list[dict]) -> list[Summary]:
    """Per backend: action tokens scored per second in one pass, and per-turn time / one-pass time."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = {(r["repeat"], r["mode"]): r for r in rows if r["backend"] == backend}
        repeats = sorted({k for k, _ in mine})
        out.append(Summary.of(f"{backend} teacher, one pass per trajectory: action tok/s",
                              [mine[(k, "one_pass")]["action_tokens_per_s"] for k in repeats], "tok/s"))
        out.append(Summary.of(f"{backend} teacher: one pass per trajectory vs one per turn (time ratio)",
                              [mine[(k, "per_turn")]["seconds"] / mine[(k, "one_pass")]["seconds"] for k in repeats],
                              "x"))
    return out


def engine_summaries(rows: list[dict]) -> list[Summary]:
    """Section 1: per backend and engine, episode-turns/s as a ratio to lock-step's, paired per repeat."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        base = {r["repeat"]: r["episode_turns_per_s"] for r in mine if r["mode"] == "lock-step batches"}
        out.append(Summary.of(f"{backend}, lock-step batches: episode-turns/s", list(base.values()), "turns/s"))
        for mode in dict.fromkeys(r["mode"] for r in mine if r["mode"] != "lock-step batches"):
            out.append(Summary.of(f"{backend}, {mode} / lock-step", [r["episode_turns_per_s"] / base[r["repeat"]]
                                                                      for r in mine if r["mode"] == mode], "x"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a model folder, a model preparation name, or 'tiny'")
    installed = ["transformers", *(["vllm"] if importlib.util.find_spec("vllm") else [])]
    parser.add_argument("--backends", nargs="+", default=installed, help="default: those installed here")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--turns", type=int, default=1, help="turns per episode (the depth cap)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--teacher-trajectories", type=int, default=2)
    parser.add_argument("--teacher-turns", type=int, default=6, help="at most this many turns per expert chat")
    parser.add_argument("--skip-rollouts", action="store_true")
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "quickstart.yaml", help="section 1's recipe")
    parser.add_argument("--episodes", type=int, default=32, help="section 1: episodes per mode and repeat")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="every section's repeats")
    parser.add_argument("--engines-only", action="store_true", help="section 1 only")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--skip-teachers", action="store_true")
    parser.add_argument("--one-repeat", type=int, help=argparse.SUPPRESS)  # set for the child processes
    parser.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backends = " and ".join(args.backends)
    if not args.skip_engines:
        engine_rows = bench_engines(args.recipe, args.backends, args.episodes, args.repeats)
        print(engine_report(engine_rows))
        save_result(f"rollout_engines_{'_'.join(args.backends)}", f"agent loop vs lock-step engine ({backends}), "
                    f"quickstart batches, {args.episodes} episodes", engine_summaries(engine_rows), engine_rows)
    if args.engines_only:
        return 0
    model_dir = resolve_model(args.model)
    if args.one_repeat is not None:  # a child process: one repeat of sections 2 and 3, rows to a file
        rows = {"rollouts": [] if args.skip_rollouts else bench_rollouts(
                    model_dir, args.backends, args.batch_sizes, args.turns, args.max_new_tokens, repeats=1),
                "teachers": [] if args.skip_teachers else bench_teachers(
                    model_dir, args.backends, args.teacher_trajectories, args.teacher_turns, repeats=1)}
        args.rows_out.write_text(json.dumps(rows))
        return 0
    if args.skip_rollouts and args.skip_teachers:
        return 0
    rows = repeats_in_processes(argv if argv is not None else sys.argv[1:], args.repeats)
    model = model_dir.name
    if not args.skip_rollouts:
        # vLLM's CPU worker binds its own threads; transformers gets OMP_NUM_THREADS: part of the condition
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        save_result(f"rollout_backends_omp{threads}", f"student rollouts, OMP_NUM_THREADS={threads}, {backends} ({model} fp32, real ALFWorld, 2 env workers, "
                    f"{args.turns} turn(s) of <= {args.max_new_tokens} tokens), a process per repeat",
                    rollout_summaries(rows["rollouts"]), rows["rollouts"])
    if not args.skip_teachers:
        save_result("teacher_scoring", f"teacher scoring, one pass per trajectory vs one per turn ({backends}, {model} "
                    f"fp32, {args.teacher_trajectories} ALFWorld expert chats of <= {args.teacher_turns} turns), "
                    "a process per repeat", teacher_summaries(rows["teachers"]), rows["teachers"])
    return 0


def repeats_in_processes(argv: list[str], repeats: int) -> dict[str, list[dict]]:
    """Run sections 2 and 3 once per repeat, each in a fresh process (this script with --one-repeat),
    and gather their rows, numbered by repeat."""
    import subprocess
    import tempfile

    gathered: dict[str, list[dict]] = {"rollouts": [], "teachers": []}
    with tempfile.TemporaryDirectory(prefix="turnopd-bench-") as scratch:
        for repeat in range(repeats):
            out = Path(scratch) / f"repeat{repeat}.json"
            print(f"--- repeat {repeat + 1}/{repeats}, a fresh process ---", flush=True)
            subprocess.run([sys.executable, __file__, *argv, "--skip-engines", "--one-repeat", str(repeat),
                            "--rows-out", str(out)], check=True)
            for section, rows in json.loads(out.read_text()).items():
                gathered[section] += [{**row, "repeat": repeat} for row in rows]
    return gathered


if __name__ == "__main__":
    sys.exit(main())
