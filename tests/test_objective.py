"""Hand-worked checks of every token-weight mode, estimator and diagnostic in turnopd.algorithm.objective."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnopd.algorithm.objective import (
    ADVANTAGES,
    WeightParams,
    deep_turn_share,
    divergence,
    final_token_weights,
    full_vocab_loss,
    gather_logprobs,
    k1_loss,
    k3_loss,
    nll_loss,
    per_trajectory_turn_means,
    policy_gradient_loss,
    token_weights,
    topk_loss,
    turn_kl_profile,
)

# A batch of two trajectories:
#   trajectory 0: turn 0 has 3 tokens, turn 1 has 1 token   -> n_0 = 4, T_0 = 2
#   trajectory 1: turn 0 has 1 token,  turn 1 has 1 token   -> n_1 = 2, T_1 = 2
# N_traj = 2, N_tokens = 6.
TRAJ = torch.tensor([0, 0, 0, 0, 1, 1])
TURN = torch.tensor([0, 0, 0, 1, 0, 1])


def approx(values):
    return pytest.approx(values, rel=1e-6, abs=1e-9)


def test_token_mean_weights():
    # every token 1/N_tokens = 1/6
    assert token_weights(TRAJ, TURN, "token_mean").tolist() == approx([1 / 6] * 6)
    assert token_weights(TRAJ, TURN, "token").tolist() == approx([1 / 6] * 6)  # the design's name, docs/algorithm.md


def test_trajectory_weights():
    # 1/(N_traj n_i): trajectory 0 -> 1/(2*4) = 0.125, trajectory 1 -> 1/(2*2) = 0.25
    assert token_weights(TRAJ, TURN, "trajectory").tolist() == approx([0.125] * 4 + [0.25] * 2)
    assert token_weights(TRAJ, TURN, "sequence").tolist() == approx([0.125] * 4 + [0.25] * 2)


def test_turn_weights():
    # 1/(N_traj T_i n_it): traj 0 turn 0 -> 1/(2*2*3) = 1/12; traj 0 turn 1 -> 1/(2*2*1) = 0.25;
    # traj 1 turns 0 and 1 -> 1/(2*2*1) = 0.25
    assert token_weights(TRAJ, TURN, "turn").tolist() == approx([1 / 12] * 3 + [0.25] * 3)


def test_constant_weights():
    # 1/(N_traj k) with k = 5 -> 0.1 each; they do not sum to 1 (sum 0.6): long trajectories not down-weighted
    w = token_weights(TRAJ, TURN, "constant", constant_k=5)
    assert w.tolist() == approx([0.1] * 6)


def test_progressive_weights_hand_worked():
    # alpha = 0.25: w = ((1 - a)/n_i + a/(T_i n_it)) / N_traj
    # traj 0 turn 0: (0.75/4 + 0.25/(2*3)) / 2 = (0.1875 + 0.041666..) / 2 = 0.114583..
    # traj 0 turn 1: (0.75/4 + 0.25/(2*1)) / 2 = (0.1875 + 0.125) / 2 = 0.15625
    # traj 1 turns:  (0.75/2 + 0.25/(2*1)) / 2 = (0.375 + 0.125) / 2 = 0.25
    w = token_weights(TRAJ, TURN, "progressive", alpha=0.25)
    assert w.tolist() == approx([0.11458333333] * 3 + [0.15625] + [0.25] * 2)
    assert float(w.sum()) == pytest.approx(1.0)


def test_progressive_turn_weight_is_the_blend_of_token_share_and_uniform():
    # docs/algorithm.md's per-turn weight: q_blend(t) = (1-a) n_t / sum_j n_j + a / T, over a trajectory.
    # Traj 0, a = 0.25: turn 0 q = 0.75 * 3/4 + 0.25/2 = 0.6875; turn 1 q = 0.75 * 1/4 + 0.125 = 0.3125
    w = token_weights(TRAJ, TURN, "progressive", alpha=0.25)
    assert float(w[:3].sum()) * 2 == pytest.approx(0.6875)  # times N_traj = 2
    assert float(w[3]) * 2 == pytest.approx(0.3125)


def test_weights_with_global_normalizers():
    # a rank holding trajectory 0 only, of a global batch of 4 trajectories and 10 tokens
    w = token_weights(TRAJ[:4], TURN[:4], "trajectory", num_trajectories=4)
    assert w.tolist() == approx([1 / (4 * 4)] * 4)
    w = token_weights(TRAJ[:4], TURN[:4], "token_mean", num_tokens=10)
    assert w.tolist() == approx([0.1] * 4)


def test_turns_without_tokens_do_not_count_in_T():
    # trajectory 0 has tokens at turns 0 and 2 only: T_0 = 2 (turn 1 produced no student tokens)
    w = token_weights(torch.tensor([0, 0]), torch.tensor([0, 2]), "turn")
    assert w.tolist() == approx([0.5, 0.5])


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        token_weights(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), "turn")
    with pytest.raises(KeyError, match="unknown loss mode 'bogus'"):
        token_weights(TRAJ, TURN, "bogus")
    with pytest.raises(ValueError, match="alpha"):
        token_weights(TRAJ, TURN, "progressive", alpha=1.5)


@st.composite
def batches(draw):
    n_traj = draw(st.integers(1, 5))
    traj_ids, turn_ids = [], []
    for i in range(n_traj):
        for t in range(draw(st.integers(1, 6))):
            n = draw(st.integers(1, 7))
            traj_ids += [i] * n
            turn_ids += [t] * n
    return torch.tensor(traj_ids), torch.tensor(turn_ids)


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0.0, 1.0))
def test_normalized_modes_sum_to_one_and_progressive_interpolates(batch, alpha):
    traj, turn = batch
    for mode in ("token_mean", "trajectory", "turn", "progressive"):
        assert float(token_weights(traj, turn, mode, alpha=alpha).double().sum()) == pytest.approx(1.0, abs=1e-5)
    w_traj = token_weights(traj, turn, "trajectory")
    w_turn = token_weights(traj, turn, "turn")
    w_prog = token_weights(traj, turn, "progressive", alpha=alpha)
    assert torch.allclose(w_prog, (1 - alpha) * w_traj + alpha * w_turn, atol=1e-6)
    assert torch.allclose(token_weights(traj, turn, "progressive", alpha=0.0), w_traj)
    assert torch.allclose(token_weights(traj, turn, "progressive", alpha=1.0), w_turn)


# ---------------------------------------------------------------------------- estimators

def test_k1_value_and_gradient():
    # s_old = ln 0.5, T = ln 0.25 -> A = -(ln 0.5 - ln 0.25) = -ln 2; at s_new = s_old ratio = 1
    # l = -ratio * A = ln 2 = 0.6931...; dl/ds_new = -A * ratio = ln 2
    s_old = torch.tensor([math.log(0.5)])
    teacher = torch.tensor([math.log(0.25)])
    s_new = s_old.clone().requires_grad_(True)
    loss = k1_loss(s_new, s_old, teacher)
    assert loss.item() == pytest.approx(math.log(2))
    loss.sum().backward()
    assert s_new.grad.item() == pytest.approx(math.log(2))


def test_k1_ppo_clip():
    # A = +ln 2 (teacher likes the token more: s_old = ln .25, T = ln .5); ratio = e^{ln 1.5} = 1.5
    # unclipped -1.5 A, clipped -1.2 A (eps 0.2): l = max(-1.5A, -1.2A) = -1.2 ln 2, and no gradient
    s_old = torch.tensor([math.log(0.25)])
    teacher = torch.tensor([math.log(0.5)])
    s_new = (s_old + math.log(1.5)).requires_grad_(True)
    loss = k1_loss(s_new, s_old, teacher, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2 * math.log(2))
    loss.sum().backward()
    assert s_new.grad.item() == pytest.approx(0.0)


def test_k3_value_and_gradient():
    # s = ln 0.5, T = ln 0.25: T - s = -ln 2; l = e^{-ln2} + ln 2 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # dl/ds = -e^{T-s} + 1 = -0.5 + 1 = 0.5
    s = torch.tensor([math.log(0.5)], requires_grad=True)
    loss = k3_loss(s, torch.tensor([math.log(0.25)]))
    assert loss.item() == pytest.approx(0.5 + math.log(2) - 1)
    loss.sum().backward()
    assert s.grad.item() == pytest.approx(0.5)


def test_nll():
    s = torch.tensor([math.log(0.25)])
    assert nll_loss(s).item() == pytest.approx(math.log(4))


# Student p_s = [.5, .3, .1, .1], teacher p_t = [.6, .2, .1, .1]; teacher top-2 ids = [0, 1].
# With tail buckets: S = [.5, .3, .2], T = [.6, .2, .2].
P_S, P_T = [0.5, 0.3, 0.2], [0.6, 0.2, 0.2]


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_topk_reverse_forward_jsd_hand_worked():
    s_top = torch.log(torch.tensor([[0.5, 0.3]]))
    t_top = torch.log(torch.tensor([[0.6, 0.2]]))
    # reverse = .5 ln(.5/.6) + .3 ln(.3/.2) + .2 ln(.2/.2) = -0.091161 + 0.121640 + 0 = 0.030479
    assert topk_loss(s_top, t_top, "reverse").item() == pytest.approx(0.030479, abs=1e-6)
    # forward = .6 ln(.6/.5) + .2 ln(.2/.3) + 0 = 0.109393 - 0.081093 = 0.028300
    assert topk_loss(s_top, t_top, "forward").item() == pytest.approx(0.028300, abs=1e-6)
    # jsd beta = .5: M = [.55, .25, .2]; .5 KL(T||M) + .5 KL(S||M)
    m = [0.55, 0.25, 0.2]
    expected = 0.5 * _kl(P_T, m) + 0.5 * _kl(P_S, m)
    assert topk_loss(s_top, t_top, "jsd", beta=0.5).item() == pytest.approx(expected, abs=1e-6)


def test_topk_padding_slots_are_ignored():
    s_top = torch.log(torch.tensor([[0.5, 0.3, 0.05]]))
    t_top = torch.tensor([[math.log(0.6), math.log(0.2), float("-inf")]])  # k=2 padded to 3
    assert topk_loss(s_top, t_top, "reverse").item() == pytest.approx(0.030479, abs=1e-6)


def test_divergence_rejects_bad_kind_and_beta():
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="allowed: reverse, forward, jsd"):
        divergence(p, p, "tv")
    with pytest.raises(ValueError, match="0 < beta < 1"):
        divergence(p, p, "jsd", beta=1.0)


def _full_reference(hs, ws, ht, wt, kind="reverse"):
    ls = torch.log_softmax(hs @ ws.T, -1)
    lt = torch.log_softmax(ht @ wt.T, -1)
    ps, pt = ls.exp(), lt.exp()
    if kind == "reverse":
        return (ps * (ls - lt)).sum(-1)
    return (pt * (lt - ls)).sum(-1)


@pytest.mark.parametrize("kind", ["reverse", "forward"])
def test_full_vocab_chunked_equals_unchunked_and_reference(kind):
    g = torch.Generator().manual_seed(0)
    hs, ws = torch.randn(13, 8, generator=g), torch.randn(40, 8, generator=g)
    ht, wt = torch.randn(13, 6, generator=g), torch.randn(40, 6, generator=g)
    hs1, hs2 = hs.clone().requires_grad_(True), hs.clone().requires_grad_(True)
    chunked = full_vocab_loss(hs1, ws, ht, wt, kind=kind, chunk_size=4)
    whole = full_vocab_loss(hs2, ws, ht, wt, kind=kind, chunk_size=1000)
    assert torch.allclose(chunked, whole, atol=1e-6)
    assert torch.allclose(chunked, _full_reference(hs, ws, ht, wt, kind), atol=1e-5)
    chunked.sum().backward()
    whole.sum().backward()
    assert torch.allclose(hs1.grad, hs2.grad, atol=1e-6)


def test_full_vocab_forward_keeps_no_logits_for_backward():
    # With checkpointing, autograd keeps only each chunk's inputs (hidden rows, heads) from the
    # forward; the [chunk, V] logits are recomputed in backward. Record what the forward saves:
    # nothing larger than a head (V x d = 500 x 4 = 2000 elements), while one chunk's logits
    # would be chunk x V = 8 x 500 = 4000.
    n, v, d, chunk = 64, 500, 4, 8
    hs = torch.randn(n, d, requires_grad=True)
    ws, ht, wt = torch.randn(v, d), torch.randn(n, d), torch.randn(v, d)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = full_vocab_loss(hs, ws, ht, wt, chunk_size=chunk).sum()
    assert saved and max(saved) <= v * d < chunk * v
    loss.backward()
    assert hs.grad is not None and torch.isfinite(hs.grad).all()


def _peak_rss_growth_mb(chunk_size: int) -> float:
    # A subprocess, with glibc returning every large block to the OS at once (MALLOC_MMAP_THRESHOLD_),
    # so that peak RSS measures live tensors rather than allocator caching.
    code = textwrap.dedent(f"""
        import resource, torch
        from turnopd.algorithm.objective import full_vocab_loss
        torch.manual_seed(0)
        hs = torch.randn(2048, 32, requires_grad=True); ws = torch.randn(50000, 32)
        ht = torch.randn(2048, 32); wt = torch.randn(50000, 32)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        full_vocab_loss(hs, ws, ht, wt, chunk_size={chunk_size}).sum().backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PATH": ""})
    return float(out.stdout.strip().splitlines()[-1])


def test_full_vocab_peak_memory_stays_bounded_on_a_large_vocabulary():
    # N=2048 tokens x V=50,000: one [N, V] fp32 tensor is 2048*50000*4 B = 410 MB, and the divergence
    # needs several (logits, log-softmax, probabilities for student and teacher, gradients).
    # Chunks of 128 rows hold ~25.6 MB per such tensor.
    chunked = _peak_rss_growth_mb(128)
    whole = _peak_rss_growth_mb(2048)
    assert chunked < 400, f"chunked peak grew by {chunked:.0f} MB"
    assert whole > 4 * chunked, f"unchunked {whole:.0f} MB vs chunked {chunked:.0f} MB"


def test_gather_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(9, 5, generator=g), torch.randn(30, 5, generator=g)
    ids = torch.randint(0, 30, (9,), generator=g)
    ref = torch.log_softmax(h @ w.T, -1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.allclose(gather_logprobs(h, w, ids, chunk_size=2), ref, atol=1e-6)
    ids2 = torch.randint(0, 30, (9, 3), generator=g)
    ref2 = torch.log_softmax(h @ w.T, -1).gather(-1, ids2)
    assert torch.allclose(gather_logprobs(h, w, ids2, chunk_size=4), ref2, atol=1e-6)


# ---------------------------------------------------------------------------- diagnostics

def test_deep_turn_share_hand_worked():
    # trajectory 0 depth 3: deep turns t with 3t >= 2*3 -> t = 2; trajectory 1 depth 1: 3t >= 2 -> none
    traj = torch.tensor([0, 0, 0, 1])
    turn = torch.tensor([0, 1, 2, 0])
    w = torch.tensor([0.25, 0.25, 0.25, 0.25])
    loss = torch.tensor([1.0, 2.0, 3.0, 2.0])
    # |w l| = [.25, .5, .75, .5], total 2.0; deep = .75 -> 0.375
    assert deep_turn_share(w, loss, turn, traj) == pytest.approx(0.375)
    assert deep_turn_share(w, torch.zeros(4), turn, traj) == 0.0


def test_deep_turn_share_sums_over_ranks():
    # two ranks: this one holds trajectory 0 above (deep mass .75 of 1.5); the other reports deep 0.25 of 0.5
    traj, turn = torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
    w, loss = torch.full((3,), 0.25), torch.tensor([1.0, 2.0, 3.0])

    def plus_other_rank(sums):
        return [a + b for a, b in zip(sums, [0.25, 0.5], strict=True)]

    assert deep_turn_share(w, loss, turn, traj, plus_other_rank) == pytest.approx((0.75 + 0.25) / (1.5 + 0.5))
    assert deep_turn_share(w[:0], loss[:0], turn[:0], traj[:0], plus_other_rank) == 0.5  # a rank with no token


def test_final_token_weights_by_hand():
    # TRAJ/TURN above, mode trajectory: m = [1/8]*4 + [1/4]*2 (sum 1)
    counts = (2, 6, 4)
    m, kept = final_token_weights(TRAJ, TURN, "trajectory", WeightParams(), counts)
    assert m.tolist() == approx([0.125] * 4 + [0.25] * 2) and kept is None
    # familiarity gate g = [1, 1, 1, 0, 1, 0]: sum(m g) = 3/8 + 1/4 = 5/8, so m' = m g * 8/5
    g = torch.tensor([1.0, 1, 1, 0, 1, 0])
    w, kept = final_token_weights(TRAJ, TURN, "trajectory", WeightParams(), counts, familiarity=g)
    assert w.tolist() == approx([0.2] * 3 + [0.0] + [0.4, 0.0]) and kept == pytest.approx(5 / 8)
    # then trajectory factors f = 2 (trajectory 0), 1 (trajectory 1): sum(m' f) = 1.2 + 0.4 = 1.6, scale 1/1.6
    f = torch.tensor([2.0] * 4 + [1.0] * 2, dtype=torch.float64)
    w, kept = final_token_weights(TRAJ, TURN, "trajectory", WeightParams(), counts, familiarity=g, trajectory=f)
    assert w.tolist() == approx([0.25] * 3 + [0.0] + [0.25, 0.0]) and float(w.sum()) == pytest.approx(1.0)
    # the constant mode reads constant_k from the params: 1/(N_traj k) = 1/(2 * 5)
    w, _ = final_token_weights(TRAJ, TURN, "constant", WeightParams(constant_k=5), counts)
    assert w.tolist() == approx([0.1] * 6)
    # progressive reads alpha (test_progressive_weights_hand_worked's numbers)
    w, _ = final_token_weights(TRAJ, TURN, "progressive", WeightParams(alpha=0.25), counts)
    assert w.tolist() == approx([0.11458333333] * 3 + [0.15625] + [0.25] * 2)


def test_final_token_weights_of_a_rank_without_tokens_still_joins_the_sums():
    calls = []

    def other_rank(xs):  # this rank has no token; the other holds weight 1, of which its factors kept 0.5
        calls.append(xs)
        return [xs[0] + 1.0, xs[1] + 0.5]

    empty = torch.zeros(0, dtype=torch.long)
    w, kept = final_token_weights(empty, empty, "trajectory", WeightParams(), (2, 6, 4), familiarity=torch.zeros(0),
                                  trajectory=torch.zeros(0), sum_over_ranks=other_rank)
    assert w.numel() == 0 and kept == pytest.approx(0.5) and calls == [[0.0, 0.0], [0.0, 0.0]]


def test_per_trajectory_turn_means_and_profile():
    traj = torch.tensor([0, 0, 0, 1, 1])
    turn = torch.tensor([0, 0, 1, 0, 1])
    kl = torch.tensor([1.0, 3.0, 0.5, 4.0, 2.0])
    per = per_trajectory_turn_means(kl, traj, turn, num_trajectories=3)
    # traj 0: turn 0 mean(1, 3) = 2, turn 1 = 0.5; traj 1: turn 0 = 4, turn 1 = 2; traj 2 has no tokens
    assert per == [[2.0, 0.5], [4.0, 2.0], []]
    # profile: turn 0 mean(2, 4) = 3, turn 1 mean(0.5, 2) = 1.25; a shorter trajectory only counts where alive
    assert turn_kl_profile(per) == [3.0, 1.25]
    assert turn_kl_profile([[1.0, 2.0, 3.0], [3.0]]) == [2.0, 2.0, 3.0]


# ----------------------------------------------------------------- the outcome-reward term


def test_grpo_advantage_by_hand():
    # group 0: rewards 1, 0, 1: mean 2/3, population std sqrt((1/9 + 4/9 + 1/9) / 3) = sqrt(2/9)
    # group 1: 1, 0: mean 1/2, std 1/2 -> +-1/2 / (1/2 + 1e-4)
    # group 2: one episode: nothing to compare with -> 0; group 3: 1, 1 -> 0 / (0 + eps) = 0
    grpo = ADVANTAGES.get("grpo")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    std = math.sqrt(2 / 9)
    got = grpo(rewards, groups, torch.ones(8, dtype=torch.bool))
    half = 0.5 / (0.5 + 1e-4)
    assert got.tolist() == pytest.approx([(1 / 3) / (std + 1e-4), (-2 / 3) / (std + 1e-4), (1 / 3) / (std + 1e-4),
                                          half, -half, 0.0, 0.0, 0.0])
    # an ungraded episode (an env error) is left out of its group's statistics and gets 0:
    # group 0 becomes 1, 0 (episodes 0 and 1)
    graded = torch.tensor([True, True, False, True, True, True, True, True])
    assert grpo(rewards, groups, graded).tolist()[:3] == pytest.approx([half, -half, 0.0])


def test_policy_gradient_loss_by_hand():
    s = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, -2.0])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss = policy_gradient_loss(s, old, adv)
    assert loss.tolist() == pytest.approx([-2.0, 1.0])  # -ratio * A at ratio 1
    loss.sum().backward()
    assert s.grad.tolist() == pytest.approx([-2.0, 1.0])  # -A grad s: REINFORCE
    # ratio e^0.5 = 1.6487 with A = 1 and clip 0.2: max(-1.6487, -1.2) = -1.2
    clipped = policy_gradient_loss(torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([1.0]), clip_eps=0.2)
    assert clipped.tolist() == pytest.approx([-1.2])
    # dual clip 3 on A = -1, ratio e^2 = 7.389: min(7.389, 3) = 3
    dual = policy_gradient_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([-1.0]), clip_eps=0.2,
                                dual_clip=3.0)
    assert dual.tolist() == pytest.approx([3.0])


def test_the_reward_term_takes_the_loss_modes_weights_1_over_k_or_1_over_tau():
    # the module's batch: trajectory 0 has 4 tokens, trajectory 1 has 2; advantages 1 and -1 at ratio 1
    # trajectory: w = 1/(2 * n_i): sum w g = 4 * (1/8) * (-1) + 2 * (1/4) * 1 = -1/2 + 1/2 = 0
    # constant_token_mean, k = 10: w = 1/(10 * 6): 4 * (-1) / 60 + 2 * 1 / 60 = -1/30
    traj = torch.tensor([0, 0, 0, 0, 1, 1])
    turn = torch.tensor([0, 0, 0, 1, 0, 1])
    g = policy_gradient_loss(torch.zeros(6), torch.zeros(6), torch.tensor([1.0, 1, 1, 1, -1, -1]))
    assert float((token_weights(traj, turn, "trajectory") * g).sum()) == pytest.approx(0.0)
    assert float((token_weights(traj, turn, "constant_token_mean", constant_k=10) * g).sum()) == pytest.approx(-1 / 30)
