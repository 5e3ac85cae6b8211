"""The OPD objective: per-token estimators, token-weight (loss aggregation) modes, diagnostics.

Pure functions over tensors: no I/O, no framework objects. The training loss is

    loss = sum_p w_p * (l_p + lambda * g_p)      over student action tokens p,

where l_p comes from an ESTIMATOR (k1, k1_proximal, k1_decoupled, k3, topk, full), w_p from a
TOKEN-WEIGHT mode (token_mean, trajectory, turn, turn_row_mean, constant, constant_token_mean,
progressive), and g_p is the outcome-reward term (`policy_gradient_loss` on an ADVANTAGE of the
episode's reward, `grpo`) at lambda = objective.reward_weight (0: pure OPD, no g_p computed). Notation: trajectory i has T_i turns (those with at least one student token), n_i
student tokens, n_it tokens in turn t; N_traj trajectories, N_rows turn rows (the (trajectory, turn)
pairs with student tokens: what TCOD trains as one row each) and N_tokens student tokens in the
(global) batch; s = student log-prob, T = teacher log-prob of the sampled token. Every weight mode
takes TokenCounts (tensors [N], one entry per student token of this rank) and returns w, [N].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from turnopd.core.registry import Registry

# --------------------------------------------------------------------------------------------
# Token weights (loss aggregation)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCounts:
    """Per-token counts of the structure a token belongs to (all tensors shaped like traj_ids)."""

    traj_tokens: torch.Tensor  # n_i
    turn_tokens: torch.Tensor  # n_it
    traj_turns: torch.Tensor  # T_i
    num_trajectories: int  # N_traj
    num_tokens: int  # N_tokens
    num_turn_rows: int  # N_rows


@dataclass(frozen=True)
class WeightParams:
    """What the loss modes read besides the counts: the progressive alpha, and loss.constant_k (in
    turns) of the constant modes."""

    alpha: float = 0.0
    constant_k: float | None = None


WeightFn = Callable[[TokenCounts, WeightParams], torch.Tensor]
TOKEN_WEIGHT_MODES: Registry[WeightFn] = Registry("loss mode")


@TOKEN_WEIGHT_MODES.register("token")  # the design's name, docs/algorithm.md
@TOKEN_WEIGHT_MODES.register("token_mean")
def token_mean_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """w = 1 / N_tokens: every student token of the batch weighs the same."""
    return torch.full_like(c.traj_tokens, 1.0 / c.num_tokens, dtype=torch.get_default_dtype())


@TOKEN_WEIGHT_MODES.register("sequence")  # the design's name, docs/algorithm.md
@TOKEN_WEIGHT_MODES.register("trajectory")
def trajectory_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """w = 1 / (N_traj * n_i): each trajectory its token mean (vanilla OPD, seq-mean-token-mean)."""
    return 1.0 / (c.num_trajectories * c.traj_tokens.to(torch.get_default_dtype()))


@TOKEN_WEIGHT_MODES.register("turn")
def turn_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """w = 1 / (N_traj * T_i * n_it): every turn of every trajectory weighs the same."""
    dt = torch.get_default_dtype()
    return 1.0 / (c.num_trajectories * c.traj_turns.to(dt) * c.turn_tokens.to(dt))


@TOKEN_WEIGHT_MODES.register("turn_row_mean")
def turn_row_mean_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """w = 1 / (N_rows * n_it): each turn row its token mean, then the mean over the batch's rows, so
    every turn of the batch weighs the same and trajectory i weighs T_i / N_rows. TCOD's ALFWorld F2B
    (one row per turn, loss_agg_mode seq-mean-token-mean over the minibatch's rows)."""
    dt = torch.get_default_dtype()
    return 1.0 / (c.num_turn_rows * c.turn_tokens.to(dt))


@TOKEN_WEIGHT_MODES.register("constant")
def constant_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """w = 1 / (N_traj * k), k = loss.constant_k > 0 in turns (steps): the formula of AsyncWebRL's
    docs, 1/(G k) sum_i sum_j sum_t. Long trajectories are not down-weighted; the weights total
    N_tokens / (N_traj k), which moves with the batch's mean trajectory length. AsyncWebRL's code
    computes `constant_token_mean`."""
    return torch.full_like(c.traj_tokens, 1.0 / (c.num_trajectories * p.constant_k), dtype=torch.get_default_dtype())


@TOKEN_WEIGHT_MODES.register("constant_token_mean")
def constant_token_mean_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """w = 1 / (k * N_tokens), k = loss.constant_k > 0 in turns (steps): AsyncWebRL's code
    (webgym `_compute_step_level_advantages` divides each step's advantage by
    step_adv_const_length = k steps, `ppo_actor_loss_fn` takes the token mean over the minibatch with
    its global token count). OPD's per-token loss is already per token, so nothing per trajectory
    divides: token_mean scaled by 1/k, the weights total 1/k at every step."""
    return torch.full_like(c.traj_tokens, 1.0 / (p.constant_k * c.num_tokens), dtype=torch.get_default_dtype())


@TOKEN_WEIGHT_MODES.register("progressive")
def progressive_weights(c: TokenCounts, p: WeightParams) -> torch.Tensor:
    """TurnOPD: turn t of trajectory i gets (1 - a) * n_it / n_i + a / T_i, spread evenly over its
    n_it tokens, divided by N_traj:  w = ((1 - a) / n_i + a / (T_i * n_it)) / N_traj.
    a = 0 is `trajectory`, a = 1 is `turn`."""
    if not 0.0 <= p.alpha <= 1.0:
        raise ValueError(f"progressive alpha must be in [0, 1], got {p.alpha}")
    dt = torch.get_default_dtype()
    n_i, n_it, t_i = c.traj_tokens.to(dt), c.turn_tokens.to(dt), c.traj_turns.to(dt)
    return ((1.0 - p.alpha) / n_i + p.alpha / (t_i * n_it)) / c.num_trajectories


def token_counts(
    traj_ids: torch.Tensor,
    turn_ids: torch.Tensor,
    num_trajectories: int | None = None,
    num_tokens: int | None = None,
    num_turn_rows: int | None = None,
) -> TokenCounts:
    """Count n_i, n_it, T_i for every token. N_traj defaults to the trajectories present, N_tokens to
    len(traj_ids) and N_rows to the turn rows present; pass the global values when a rank holds part
    of the batch."""
    if traj_ids.ndim != 1 or traj_ids.shape != turn_ids.shape:
        raise ValueError(f"traj_ids and turn_ids must be equal 1-D shapes, got {tuple(traj_ids.shape)} "
                         f"and {tuple(turn_ids.shape)}")
    if traj_ids.numel() == 0:
        raise ValueError("token_weights got an empty batch (no student tokens)")
    if int(turn_ids.min()) < 0:
        raise ValueError("turn_ids must be >= 0 on student tokens")
    _, traj_inv, n_i = torch.unique(traj_ids, return_inverse=True, return_counts=True)
    stride = int(turn_ids.max()) + 1
    pair_u, pair_inv, n_it = torch.unique(traj_inv * stride + turn_ids, return_inverse=True, return_counts=True)
    turns_per_traj = torch.bincount(pair_u // stride, minlength=n_i.numel())
    return TokenCounts(
        traj_tokens=n_i[traj_inv],
        turn_tokens=n_it[pair_inv],
        traj_turns=turns_per_traj[traj_inv],
        num_trajectories=int(n_i.numel()) if num_trajectories is None else num_trajectories,
        num_tokens=int(traj_ids.numel()) if num_tokens is None else num_tokens,
        num_turn_rows=int(pair_u.numel()) if num_turn_rows is None else num_turn_rows,
    )


def turn_row_index(traj_ids: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Per student token [N], the index of its turn row (its (trajectory, turn) pair) among the batch's
    rows 0..N_rows-1, ordered by trajectory index, then turn index: the batch order."""
    stride = int(turn_ids.max()) + 1 if turn_ids.numel() else 1
    return torch.unique(traj_ids * stride + turn_ids, return_inverse=True)[1]


def token_weights(
    traj_ids: torch.Tensor,
    turn_ids: torch.Tensor,
    mode: str,
    alpha: float = 0.0,
    constant_k: float | None = None,
    num_trajectories: int | None = None,
    num_tokens: int | None = None,
    num_turn_rows: int | None = None,
) -> torch.Tensor:
    """Per-token weights w (loss = sum(w * per_token_loss)) for the student tokens described by
    their trajectory index and turn index. See TOKEN_WEIGHT_MODES for each mode's formula.
    In the normalized modes (all but `constant` and `constant_token_mean`) the weights sum to 1 over
    the global batch."""
    fn = TOKEN_WEIGHT_MODES.get(mode)
    return fn(token_counts(traj_ids, turn_ids, num_trajectories, num_tokens, num_turn_rows),
              WeightParams(alpha, constant_k))


SumOverRanks = Callable[[list[float]], list[float]]


def summed_here(values: list[float]) -> list[float]:
    """The sums over ranks of a one-process batch: the values themselves."""
    return values


def reweight(weights: torch.Tensor, factors: torch.Tensor, total_before: float, total_after: float) -> torch.Tensor:
    """w' = w g W / W' with the global sums W = sum w and W' = sum w g (w' = 0 when W' = 0: every
    token was weighted out, and the step trains on nothing)."""
    if total_after <= 0:
        return torch.zeros_like(weights)
    return weights * factors.to(weights) * (total_before / total_after)


def rescaled(weights: torch.Tensor, factors: torch.Tensor, sum_over_ranks: SumOverRanks
             ) -> tuple[torch.Tensor, float]:
    """`reweight` with W and W' summed over the global batch (sum_over_ranks: every rank calls it), so
    the factors g move weight between tokens and keep the total; and the share W' / W the factors
    kept (0 when W is 0)."""
    before, after = sum_over_ranks([float(weights.double().sum()), float((weights.double() * factors).sum())])
    return reweight(weights, factors, before, after), after / before if before > 0 else 0.0


def final_token_weights(traj_ids: torch.Tensor, turn_ids: torch.Tensor, mode: str, params: WeightParams,
                        counts: tuple[int, int, int], familiarity: torch.Tensor | None = None,
                        trajectory: torch.Tensor | None = None, sum_over_ranks: SumOverRanks = summed_here
                        ) -> tuple[torch.Tensor, float | None]:
    """The weight w_p of every action token p in the loss sum_p w_p l_p, and the share of the weight
    the familiarity factors kept (None without them):

        m_p  = the loss mode's weight (TOKEN_WEIGHT_MODES; counts = (N_traj, N_tokens, N_rows) of the
               global batch, alpha and constant_k from `params`)
        m'_p = m_p g_p sum(m) / sum(m g)      g_p: its turn's familiarity factor (familiarity_factors)
        w_p  = m'_p f_p sum(m') / sum(m' f)   f_p: its trajectory's loss-weight factor (Trajectory.loss_weight)

    Each factor, when given, moves weight between tokens and keeps the step's total (sums over all
    ranks through `sum_over_ranks`, which every rank calls for each factor given, even with no token).
    Shapes: traj_ids, turn_ids, familiarity, trajectory [n] (n may be 0); returns [n]."""
    num_trajectories, num_tokens, num_turn_rows = counts
    weights = (token_weights(traj_ids, turn_ids, mode, params.alpha, params.constant_k, num_trajectories, num_tokens,
                             num_turn_rows) if traj_ids.numel() else torch.zeros(0))
    kept = None
    if familiarity is not None:
        weights, kept = rescaled(weights, familiarity, sum_over_ranks)
    if trajectory is not None:
        weights = rescaled(weights, trajectory, sum_over_ranks)[0]
    return weights, kept


# --------------------------------------------------------------------------------------------
# Divergences between two distributions given as log-probs over the same support (last dim)
# --------------------------------------------------------------------------------------------

KL_KINDS = ("reverse", "forward", "jsd")


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last dim; p_v = 0 contributes 0."""
    terms = logp.exp() * (logp - logq)
    return torch.where(torch.isneginf(logp), torch.zeros_like(terms), terms).sum(-1)


def divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str = "reverse",
               beta: float = 0.5) -> torch.Tensor:
    """Per-row divergence between student S and teacher T (log-probs over the last dim).

    reverse: KL(S || T) = sum S (log S - log T)                          (OPD's objective)
    forward: KL(T || S) = sum T (log T - log S)
    jsd:     beta * KL(T || M) + (1 - beta) * KL(S || M),  M = beta * T + (1 - beta) * S,
             0 < beta < 1 (TRL GKD's generalized JSD; its beta=0/1 limits are forward/reverse).
    """
    if kind == "reverse":
        return _kl(student_logp, teacher_logp)
    if kind == "forward":
        return _kl(teacher_logp, student_logp)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta} (use kind='forward' or 'reverse')")
        mixture = torch.logsumexp(
            torch.stack([teacher_logp + torch.log(torch.tensor(beta)),
                         student_logp + torch.log(torch.tensor(1.0 - beta))]), dim=0)
        return beta * _kl(teacher_logp, mixture) + (1.0 - beta) * _kl(student_logp, mixture)
    raise ValueError(f"unknown divergence kind {kind!r}; allowed: {', '.join(KL_KINDS)}")


# --------------------------------------------------------------------------------------------
# Per-token estimators
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenInputs:
    """What an estimator may read at the action tokens of a micro-batch, [n] or [n, k] (None where
    the trainer did not compute it): the student's log-prob s of each token (with grad), its log-prob
    at sampling time s_old (the behaviour policy's), its log-prob s_prox under the weights the trainer's
    step started from (the proximal policy's, no grad), the teacher's T; the student's and the
    teacher's log-probs of the teacher's top-k ids, and those ids (a teacher of another tokenizer's in
    the student's vocabulary, -1 where it lacks the text: topk_cross); for topk_cross, the student ids
    [V] no teacher id is paired with and the student's k largest log-probs among them; the student's
    hidden states and output head, and the teacher's, when the teacher runs in the training process;
    the reward term's advantage A of each token's episode (objective.reward_weight > 0)."""

    student: torch.Tensor | None = None
    sampling: torch.Tensor | None = None
    proximal: torch.Tensor | None = None
    teacher: torch.Tensor | None = None
    student_topk: torch.Tensor | None = None
    teacher_topk: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    student_rest_mask: torch.Tensor | None = None
    student_rest: torch.Tensor | None = None
    student_hidden: torch.Tensor | None = None
    student_head: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None
    teacher_head: torch.Tensor | None = None
    advantage: torch.Tensor | None = None


@dataclass(frozen=True)
class Estimator:
    """A registered per-token estimator: its pure function, how the trainer's TokenInputs and the
    recipe's `objective` settings (clip_eps, dual_clip, behave_weight_cap, kind, jsd_beta, chunk_size) bind to its arguments, and
    what the loop must provide for it. Scoring, the pre-flight checks and the trainer read these,
    so each is decided in one place."""

    name: str
    fn: Callable[..., torch.Tensor]
    bind: Callable[[TokenInputs, Any], tuple]  # (inputs, objective settings) -> fn's arguments
    needs_teacher_logprobs: bool = True  # the teacher's log-prob of each sampled token, scored before the step
    needs_teacher_topk: bool = False  # the teacher's top-k ids and log-probs (objective.topk)
    needs_teacher_model: bool = False  # the teacher's model in the training process (whole vocabulary)
    # the teacher's top-k in its own vocabulary, mapped to the student's (objective.tokenizers=cross)
    needs_vocab_map: bool = False
    needs_sampling_logprobs: bool = False  # the student's log-prob at sampling time (importance ratio)
    # the student's log-prob under the weights the trainer's step started from (the trainer computes it)
    needs_proximal_logprobs: bool = False
    kinds: tuple[str, ...] = ("reverse",)  # the divergences it can estimate (objective.kind)

    @property
    def has_behaviour_weight(self) -> bool:
        """Whether it also weighs a token by pi_prox / pi_behave (what objective.behave_weight_cap caps)."""
        return self.needs_sampling_logprobs and self.needs_proximal_logprobs

    @property
    def uses_teacher(self) -> bool:
        """Whether it distills at all (nll is supervised fine-tuning on the batch's own tokens)."""
        return self.needs_teacher_logprobs or self.needs_teacher_topk or self.needs_teacher_model

    @property
    def needs_scoring(self) -> bool:
        """Whether the trajectories go to the teacher before the step (a teacher in the training
        process computes what it needs inside the step, and is not run twice)."""
        return self.needs_teacher_logprobs or self.needs_teacher_topk

    def token_loss(self, inputs: TokenInputs, settings: Any) -> torch.Tensor:
        """Per-token loss l_p of the micro-batch's action tokens."""
        return self.fn(*self.bind(inputs, settings))


ESTIMATORS: Registry[Estimator] = Registry("estimator")


def estimator(name: str, bind: Callable[[TokenInputs, Any], tuple], **needs: Any
              ) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Register the decorated function as estimator `name`, with its binding and needs."""
    def add(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        ESTIMATORS.register(name)(Estimator(name, fn, bind, **needs))
        return fn

    return add


def ppo_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, clip_eps: float | None = None,
                  dual_clip: float | None = None) -> torch.Tensor:
    """The PPO loss of tokens with importance ratio r and advantage A, all [n]:
    l = -r A; with clip_eps, l = max(-r A, -clip(r, 1 - eps, 1 + eps) A); with dual_clip c > 1, on the
    tokens with A < 0, l = min(l, -c A) (verl's and AReaL's dual clip: a negative-advantage token
    costs at most c |A|, however large its ratio)."""
    loss = -ratio * advantage
    if clip_eps is not None:
        loss = torch.maximum(loss, -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantage)
    if dual_clip is not None:
        loss = torch.where(advantage < 0, torch.minimum(loss, -dual_clip * advantage), loss)
    return loss


@estimator("k1", lambda x, o: (x.student, x.sampling, x.teacher, o.clip_eps, o.dual_clip), needs_sampling_logprobs=True)
def k1_loss(student_logprobs: torch.Tensor, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
            clip_eps: float | None = None, dual_clip: float | None = None) -> torch.Tensor:
    """Sampled-token reverse KL used as a reward (tinker-cookbook / slime OPD), coupled PPO: all [n].

    A = -(s_old - T) (detached; s_old = the log-prob the token was sampled with, the behaviour
    policy's), ratio = exp(s_new - s_old) = pi_theta / pi_behave,   l = -ratio * A,
    or with clip_eps / dual_clip the PPO form of `ppo_surrogate` on that ratio.
    Its gradient at ratio = 1 is (s - T) * grad s, the score-function gradient of KL(S || T).
    """
    advantage = -(old_logprobs - teacher_logprobs).detach()
    ratio = torch.exp(student_logprobs - old_logprobs.detach())
    return ppo_surrogate(ratio, advantage, clip_eps, dual_clip)


@estimator("k1_proximal", lambda x, o: (x.student, x.teacher))
def k1_proximal_loss(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 around the log-prob the trainer recomputes before each update, TCOD's estimator (verl's PPO
    loss, advantage = teacher - old log-prob, the old log-probs recomputed by the trainer), all [n]:

    s_prox = s detached (the update's own forward), A = T - s_prox, ratio = exp(s - s_prox) = 1,
    l = -ratio * A: the value s - T, the gradient (s - T) * grad s.
    The sampling log-prob is never read: a token sampled by older weights (pipeline one_step_off,
    pool) is trained as if the current student had sampled it. TCOD's clip (0.2) and dual clip (3)
    never bind on a ratio of 1 (each of its 64-row updates recomputes its old log-probs first), so
    none is taken here."""
    proximal = student_logprobs.detach()
    return -torch.exp(student_logprobs - proximal) * (teacher_logprobs - proximal).detach()


@estimator("k1_decoupled", lambda x, o: (x.student, x.proximal, x.sampling, x.teacher, o.clip_eps, o.dual_clip,
                                          o.behave_weight_cap),
           needs_sampling_logprobs=True, needs_proximal_logprobs=True)
def k1_decoupled_loss(student_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      teacher_logprobs: torch.Tensor, clip_eps: float | None = None, dual_clip: float | None = None,
                      behave_weight_cap: float | None = None) -> torch.Tensor:
    """Decoupled PPO (AReaL's `ppo_actor_loss_fn` with use_decoupled_loss, as AsyncWebRL runs it) on
    OPD's reward, all [n]:

    A = T - s_prox, ratio = exp(s - s_prox) = pi_theta / pi_prox, l = b * `ppo_surrogate`(ratio, A),
    b = exp(s_prox - s_old) = pi_prox / pi_behave (detached, unclipped): the clip acts on
    pi_theta / pi_prox, the behaviour weight corrects the sampling. s_prox is the student's log-prob
    under the weights the trainer's step started from: the step's own forward when it is one update
    (ratio 1, the behaviour weight alone acts), a forward before the first when it takes several
    (trainer.turn_rows_per_update; AReaL recomputes it once per batch of ppo_n_minibatches updates).
    With behave_weight_cap, tokens with b > cap get b = 0: dropped from the gradient, still counted
    in the loss mode's denominators (AReaL's behav_mask)."""
    proximal = proximal_logprobs.detach()
    behaviour = torch.exp(proximal - old_logprobs).detach()
    if behave_weight_cap is not None:
        behaviour = torch.where(behaviour <= behave_weight_cap, behaviour, torch.zeros_like(behaviour))
    surrogate = ppo_surrogate(torch.exp(student_logprobs - proximal), (teacher_logprobs - proximal).detach(),
                              clip_eps, dual_clip)
    return behaviour * surrogate


@estimator("k3", lambda x, o: (x.student, x.teacher))
def k3_loss(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Low-variance KL estimator, differentiated directly: l = exp(T - s) - (T - s) - 1 (>= 0)."""
    log_ratio = teacher_logprobs.detach() - student_logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@estimator("nll", lambda x, o: (x.student,), needs_teacher_logprobs=False)
def nll_loss(student_logprobs: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning on the given tokens (teacher SFT): l = -s."""
    return -student_logprobs


def with_tail_bucket(topk_logp: torch.Tensor, min_tail: float = 1e-12) -> torch.Tensor:
    """Append log(1 - sum_k p_k) as a (k+1)-th bucket so the k log-probs become a distribution.
    The tail is floored at `min_tail` so that a top-k holding all the mass stays finite."""
    covered = torch.logsumexp(topk_logp, dim=-1, keepdim=True)
    tail = torch.log(torch.clamp(-torch.expm1(covered), min=min_tail))
    return torch.cat([topk_logp, tail], dim=-1)


@estimator("topk", lambda x, o: (x.student_topk, x.teacher_topk, o.kind, o.jsd_beta),
           needs_teacher_topk=True, kinds=KL_KINDS)
def topk_loss(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
              kind: str = "reverse", beta: float = 0.5) -> torch.Tensor:
    """Divergence over the teacher's top-k token ids plus one tail bucket:
    D(S_k+tail, T_k+tail) with S_k = the student's log-probs of the teacher's top-k ids and
    tail = log(1 - sum_k p). `kind` as in `divergence` (reverse, forward, jsd with beta).
    Padded top-k slots hold -inf in the teacher's log-probs and are dropped."""
    pad = torch.isneginf(teacher_topk_logprobs)
    student = torch.where(pad, torch.full_like(student_topk_logprobs, float("-inf")), student_topk_logprobs)
    return divergence(with_tail_bucket(student), with_tail_bucket(teacher_topk_logprobs), kind, beta)


@estimator("topk_cross", lambda x, o: (x.student, x.teacher, x.student_topk, x.teacher_topk, x.teacher_topk_ids,
                                        x.student_rest, o.kind, o.jsd_beta),
           needs_teacher_topk=True, needs_vocab_map=True, kinds=KL_KINDS)
def topk_cross_loss(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, student_topk_logprobs: torch.Tensor,
                    teacher_topk_logprobs: torch.Tensor, teacher_topk_student_ids: torch.Tensor,
                    student_rest_logprobs: torch.Tensor, kind: str = "reverse", beta: float = 0.5) -> torch.Tensor:
    """The teacher's top-k across vocabularies (objective.tokenizers=cross; docs/algorithm.md, "Teachers
    of another tokenizer"): exact where the two vocabularies share a token's text, ULD's sorted-probability
    distance for the rest. At a token whose position has the teacher's top-k (a span's first token):

        shared_i = the teacher's slot i has a student token of its text (teacher_topk_student_ids >= 0)
        D        = `topk_loss`(S_k, T_k masked to the shared slots): `kind` over the shared tokens + a tail
        u_t      = the teacher's probabilities at its slots without a student token, sorted descending
        u_s      = the student's k largest probabilities among its ids no teacher id is paired with
        l        = D + sum_i |u_s,i - u_t,i|          (ULD: W1 between sorted probability vectors, 0-padded)

    and at any other token (inside a span of several, or of no teacher tokens) `k3_loss`(s, T') on the
    span's share T'. With identical vocabularies every slot is shared and no id is unpaired: l is
    `topk_loss`. Shapes: student_logprobs, teacher_logprobs [n]; the other four [n, k] (teacher_topk_logprobs
    -inf on padded slots, a whole row -inf where the position has no top-k; student_topk_logprobs at
    teacher_topk_student_ids, any value where -1; student_rest_logprobs descending, -inf past its ids)."""
    shared, teacher = teacher_topk_student_ids >= 0, teacher_topk_logprobs.detach()
    exact = topk_loss(student_topk_logprobs, teacher.masked_fill(~shared, float("-inf")), kind, beta)
    teacher_rest = teacher.exp().masked_fill(shared, 0.0).sort(dim=-1, descending=True).values
    uld = (student_rest_logprobs.exp() - teacher_rest).abs().sum(-1)
    has_topk = ~torch.isneginf(teacher).all(-1)
    return torch.where(has_topk, exact + uld, k3_loss(student_logprobs, teacher_logprobs))


def _by_row_chunks(fn: Callable[..., torch.Tensor], rowwise: tuple[torch.Tensor, ...], shared: tuple[Any, ...],
                   chunk_size: int) -> torch.Tensor | None:
    """fn(*(t[rows] for t in rowwise), *shared) over `chunk_size` rows at a time, concatenated on dim 0
    (None for 0 rows); each chunk checkpointed (its [rows, V] logits recomputed in backward) when a
    gradient flows, so peak memory is O(chunk_size * V)."""
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (*rowwise, *shared))
    out = []
    for start in range(0, rowwise[0].shape[0], chunk_size):
        args = (*(t[start : start + chunk_size] for t in rowwise), *shared)
        out.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return torch.cat(out) if out else None


def _chunk_divergence(student_hidden, teacher_hidden, student_head, teacher_head, kind, beta):
    student_logp = torch.log_softmax((student_hidden @ student_head.T).float(), dim=-1)
    teacher_logp = torch.log_softmax((teacher_hidden @ teacher_head.T).float(), dim=-1)
    return divergence(student_logp, teacher_logp.detach(), kind, beta)


@estimator("full", lambda x, o: (x.student_hidden, x.student_head, x.teacher_hidden, x.teacher_head, o.kind,
                                  o.jsd_beta, o.chunk_size), needs_teacher_logprobs=False, needs_teacher_model=True,
           kinds=KL_KINDS)
def full_vocab_loss(student_hidden: torch.Tensor, student_head: torch.Tensor, teacher_hidden: torch.Tensor,
                    teacher_head: torch.Tensor, kind: str = "reverse", beta: float = 0.5,
                    chunk_size: int = 256) -> torch.Tensor:
    """D(S || T) over the whole vocabulary at each student token, S = softmax(h_s W_s^T),
    T = softmax(h_t W_t^T), `kind` as in `divergence`. Hidden states are [N, d] (action positions
    only), heads [V, d]. Logits are built `chunk_size` rows at a time and recomputed in backward
    (activation checkpointing), so peak memory is O(chunk_size * V), never O(N * V)."""
    if student_head.shape[0] != teacher_head.shape[0]:
        raise ValueError(f"student vocab {student_head.shape[0]} != teacher vocab {teacher_head.shape[0]}")
    out = _by_row_chunks(_chunk_divergence, (student_hidden, teacher_hidden.detach()),
                         (student_head, teacher_head.detach(), kind, beta), chunk_size)
    return student_hidden.new_zeros(0) if out is None else out


def _chunk_gather(hidden, ids, head):
    logits = (hidden @ head.T).float()
    return torch.gather(logits, -1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def gather_logprobs(hidden: torch.Tensor, head: torch.Tensor, ids: torch.Tensor,
                    chunk_size: int = 256) -> torch.Tensor:
    """log softmax(hidden @ head^T)[ids] for hidden [N, d], head [V, d], ids [N] or [N, k],
    chunked and checkpointed like `full_vocab_loss` (the student forward reads out only the
    action tokens' log-probs, never a whole-batch [N, V] log-softmax)."""
    squeeze = ids.ndim == 1
    ids2 = ids.unsqueeze(-1) if squeeze else ids
    result = _by_row_chunks(_chunk_gather, (hidden, ids2), (head,), chunk_size)
    result = hidden.new_zeros(0, ids2.shape[-1]) if result is None else result
    return result.squeeze(-1) if squeeze else result


def _chunk_masked_topk(hidden, head, keep, k):
    logprobs = torch.log_softmax((hidden @ head.T).float(), dim=-1)
    return logprobs.masked_fill(~keep, float("-inf")).topk(k, dim=-1).values


def masked_topk_logprobs(hidden: torch.Tensor, head: torch.Tensor, keep: torch.Tensor, k: int,
                         chunk_size: int = 256) -> torch.Tensor:
    """The k largest of log softmax(hidden @ head^T) over the ids where `keep` [V] is True, in descending
    order, for hidden [N, d], head [V, d]: [N, k], -inf past the kept ids' count. Chunked and
    checkpointed like `full_vocab_loss`; differentiable in the values kept."""
    width = min(k, head.shape[0])
    out = _by_row_chunks(_chunk_masked_topk, (hidden,), (head, keep, width), chunk_size)
    out = hidden.new_zeros(0, width, dtype=torch.float32) if out is None else out
    return torch.nn.functional.pad(out, (0, k - width), value=float("-inf"))


# --------------------------------------------------------------------------------------------
# The outcome-reward term (objective.reward_weight > 0): loss = sum_p w_p (l_p + lambda * g_p)
# --------------------------------------------------------------------------------------------

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")
GRPO_EPS = 1e-4  # WMRL's group_advantages(eps=1e-4) (xiyuanyang45/WMRL, wmrl/advantage.py)


@ADVANTAGES.register("grpo")
def grpo_outcome_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, graded: torch.Tensor,
                           eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO's group-normalised outcome advantage (verl's core_algos `compute_grpo_outcome_advantage`,
    WMRL's `group_advantages`), per episode, all [B]: over the graded episodes G_g of each group g
    (the episodes of one task in the step's batch),

        A_i = (r_i - mean_{G_g} r) / (std_{G_g} r + eps)       (std: population, WMRL's np.std)

    A_i = 0 for an episode not graded (an env error: no outcome, which is not a failure) and for every
    episode of a group with fewer than 2 graded ones (nothing to compare with). rewards float [B],
    group_ids long [B], graded bool [B]."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for g in torch.unique(group_ids).tolist():
        members = (group_ids == g) & graded
        if int(members.sum()) < 2:
            continue
        r = rewards[members].double()
        advantages[members] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return advantages


def policy_gradient_loss(student_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                         clip_eps: float | None = None, dual_clip: float | None = None) -> torch.Tensor:
    """The reward term's per-token loss g_p, all [n]: each token carries its episode's advantage A,
    ratio = exp(s - s_old) = pi_theta / pi_behave (s_old the sampling log-prob), and
    g = `ppo_surrogate`(ratio, A, clip_eps, dual_clip) = -ratio * A unclipped; its gradient at
    ratio = 1 is -A * grad s (REINFORCE with the group baseline). Weighted by the loss mode's w_p like
    the KL's, so `trajectory` takes 1/|tau| per episode and `constant` / `constant_token_mean`
    AsyncWebRL's 1/k."""
    ratio = torch.exp(student_logprobs - old_logprobs.detach())
    return ppo_surrogate(ratio, advantages.detach().to(ratio), clip_eps, dual_clip)


# --------------------------------------------------------------------------------------------
# Diagnostics
# --------------------------------------------------------------------------------------------


def is_deep_turn(turn_ids: torch.Tensor, traj_ids: torch.Tensor) -> torch.Tensor:
    """True for tokens in the deepest third of their trajectory's turns: turn t of a trajectory of
    depth D (= its largest turn index + 1) is deep when t / D >= 2/3, i.e. 3t >= 2D."""
    _, inv = torch.unique(traj_ids, return_inverse=True)
    depth = torch.zeros(int(inv.max()) + 1, dtype=torch.long).scatter_reduce(
        0, inv, turn_ids + 1, reduce="amax")
    return 3 * turn_ids >= 2 * depth[inv]


def deep_turn_share(weights: torch.Tensor, per_token_loss: torch.Tensor, turn_ids: torch.Tensor,
                    traj_ids: torch.Tensor, sum_over_ranks: SumOverRanks = summed_here) -> float:
    """Share of the weighted loss on the deepest third of each trajectory's turns:
    sum_deep |w l| / sum |w l| (absolute values, since k1 token losses can be negative; sums over all
    ranks through `sum_over_ranks`). Returns 0.0 when the total is 0. Shapes: all [n], n may be 0."""
    mass = (weights.double() * per_token_loss.double()).detach().abs()
    deep = is_deep_turn(turn_ids, traj_ids) if turn_ids.numel() else torch.zeros(0, dtype=torch.bool)
    deep_mass, total = sum_over_ranks([float(mass[deep].sum()), float(mass.sum())])
    return deep_mass / total if total > 0 else 0.0


def per_trajectory_turn_means(per_token: torch.Tensor, traj_ids: torch.Tensor, turn_ids: torch.Tensor,
                              num_trajectories: int) -> list[list[float]]:
    """Per trajectory 0..num_trajectories-1 of a batch, the mean of a per-token value (the KL, a
    familiarity signal) over each turn 0..D-1 (D = largest turn index + 1; a turn without student
    tokens reads 0.0; a trajectory without any, []). Of the KL: the input of the depth controller
    (turnopd.algorithm.controllers.probe_statistics)."""
    out: list[list[float]] = [[] for _ in range(num_trajectories)]
    for traj in torch.unique(traj_ids).tolist():
        sel = traj_ids == traj
        turns, kl = turn_ids[sel], per_token[sel].detach().double()
        depth = int(turns.max()) + 1
        sums = torch.zeros(depth, dtype=torch.float64).index_add_(0, turns, kl)
        counts = torch.bincount(turns, minlength=depth).double()
        out[traj] = (sums / counts.clamp(min=1)).tolist()
    return out


def turn_kl_profile(per_trajectory: list[list[float]]) -> list[float]:
    """The per-turn profile of a turn value (the KL, a familiarity signal): at each turn index, the
    mean over the trajectories that reached it of their turn means."""
    depth = max((len(kls) for kls in per_trajectory), default=0)
    profile = []
    for t in range(depth):
        alive = [kls[t] for kls in per_trajectory if len(kls) > t]
        profile.append(sum(alive) / len(alive))
    return profile
