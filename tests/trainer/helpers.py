"""Tiny models, synthetic scored trajectories and an independent reference loss for the trainer tests."""

from __future__ import annotations

import math
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from turnopd.config import LossConfig, ObjectiveConfig, TrainerConfig
from turnopd.core.types import Trajectory, Turn

VOCAB = 61
TOPK = 4


def tiny_llama(seed: int = 0, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied, attn_implementation="eager")
    return LlamaForCausalLM(config).float()


def random_trajectories(seed: int, count: int, max_turns: int = 4, topk: bool = False) -> list[Trajectory]:
    """Scored trajectories of random tokens. Even-numbered ones append (one sequence per trajectory),
    odd ones re-render a one-turn history window (a new sequence per turn), so both layouts occur."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        turns: list[Turn] = []
        history: list[int] = []
        for t in range(rng.randint(1, max_turns)):
            observation = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
            if i % 2 == 0:
                prompt = history + observation
            else:  # window: only the previous action, then the new observation
                prompt = (turns[-1].action_ids if turns else []) + observation
            action = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
            topk_ids = topk_lp = None
            if topk:
                topk_ids = [rng.sample(range(VOCAB), TOPK) for _ in action]
                # k probabilities and a tail bucket of at least 5% summing to 1
                mass = [[rng.uniform(0.05, 1.0) for _ in range(TOPK + 1)] for _ in action]
                topk_lp = [sorted((math.log(m / sum(row)) for m in row[:TOPK]), reverse=True) for row in mass]
            turns.append(Turn(index=t, observation="", prompt_ids=prompt, action_ids=action,
                              student_logprobs=[-rng.uniform(0.1, 5.0) for _ in action],
                              teacher_logprobs=[-rng.uniform(0.1, 5.0) for _ in action],
                              teacher_topk_ids=topk_ids, teacher_topk_logprobs=topk_lp))
            history = prompt + action
        out.append(Trajectory(task_id=f"t{i}", env_name="synthetic", turns=turns))
    return out


def configs(estimator: str = "k1", mode: str = "progressive", **trainer: object
            ) -> tuple[TrainerConfig, ObjectiveConfig, LossConfig]:
    trainer_cfg = TrainerConfig(**{"lr": 1e-2, "grad_clip": 1.0, "micro_batch_tokens": 10_000,
                                   "weight_decay": 0.01, **trainer})
    return trainer_cfg, ObjectiveConfig(estimator=estimator, topk=TOPK, chunk_size=7), LossConfig(mode=mode)


# ------------------------------------------------------------------------------------------------
# Reference: the loss from a plain full forward, written out without the trainer or objective code
# ------------------------------------------------------------------------------------------------


def reference_weights(trajectories: list[Trajectory], mode: str, alpha: float) -> list[float]:
    """Per action token, in batch order: token_mean 1/N; progressive ((1-a)/n_i + a/(T_i n_it)) / N_traj
    (T_i counts the turns with tokens, N_traj the trajectories with tokens)."""
    num_tokens = sum(t.num_action_tokens for t in trajectories)
    num_traj = sum(t.num_action_tokens > 0 for t in trajectories)  # trajectories without tokens do not count
    out = []
    for traj in trajectories:
        n_i, turns = traj.num_action_tokens, [t for t in traj.turns if t.action_ids]
        for turn in turns:
            n_it = len(turn.action_ids)
            if mode == "token_mean":
                w = 1.0 / num_tokens
            elif mode == "progressive":
                w = ((1 - alpha) / n_i + alpha / (len(turns) * n_it)) / num_traj
            else:
                raise ValueError(mode)
            out.extend([w] * n_it)
    return out


def reference_token_logprobs(model, trajectories: list[Trajectory]) -> list[torch.Tensor]:
    """Per action token (batch order), the full-vocabulary log-softmax row that predicts it, from a
    plain forward of each turn's prompt + action."""
    rows = []
    for traj in trajectories:
        for turn in traj.turns:
            ids = torch.tensor([turn.prompt_ids + turn.action_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(turn.prompt_ids)
            rows.extend(logp[start - 1 + j] for j in range(len(turn.action_ids)))
    return rows


def reference_loss(model, trajectories: list[Trajectory], estimator: str, mode: str, alpha: float,
                   teacher=None, clip_eps: float | None = None, weights: list[float] | None = None) -> torch.Tensor:
    """sum_p w_p l_p with every per-token loss written out from full-vocabulary log-probs (w_p: the
    loss mode's, or the given `weights`)."""
    weights = reference_weights(trajectories, mode, alpha) if weights is None else weights
    student_rows = reference_token_logprobs(model, trajectories)
    teacher_rows = reference_token_logprobs(teacher, trajectories) if teacher is not None else None
    tokens = [(turn, j) for traj in trajectories for turn in traj.turns for j in range(len(turn.action_ids))]
    total = torch.zeros(())
    for p, ((turn, j), w) in enumerate(zip(tokens, weights, strict=True)):
        row = student_rows[p]
        s = row[turn.action_ids[j]]
        s_old, t = turn.student_logprobs[j], turn.teacher_logprobs[j]
        if estimator == "k1":
            ratio = torch.exp(s - s_old)
            loss = -ratio * (t - s_old)  # advantage A = -(s_old - T) = T - s_old
            if clip_eps is not None:
                loss = torch.maximum(loss, -torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * (t - s_old))
        elif estimator == "k3":
            loss = torch.exp(t - s) - (t - s) - 1
        elif estimator == "nll":
            loss = -s
        elif estimator == "topk":  # reverse KL over the teacher's top-k ids plus one tail bucket each
            ids = turn.teacher_topk_ids[j]
            sk = row[ids]
            tk = torch.tensor(turn.teacher_topk_logprobs[j])
            s_all = torch.cat([sk.exp(), (1 - sk.exp().sum()).reshape(1)])
            t_all = torch.cat([tk.exp(), (1 - tk.exp().sum()).reshape(1)])
            loss = (s_all * (s_all.log() - t_all.log())).sum()
        elif estimator == "full":  # reverse KL over the whole vocabulary
            loss = (row.exp() * (row - teacher_rows[p].detach())).sum()
        else:
            raise ValueError(estimator)
        total = total + w * loss
    return total
