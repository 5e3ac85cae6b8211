"""Multi-hop search: action grammar, answer scores (SQuAD's, HotpotQA's and MuSiQue's F1 rules,
hand-worked), corpus and splits, the env, the expert, and bad input."""

from __future__ import annotations

import json
import pickle
import re
import time

import pytest

from envs import make_env_spec
from envs.base import PromptContext
from envs.search.data import load_multihop, parse_golden
from envs.search.env import INVALID_MESSAGE, format_passages, parse_search_action
from envs.search.metrics import OFFICIAL_F1, exact_match, f1_score, normalize_answer, token_f1
from turnopd.config import EnvConfig
from turnopd.core.data import DataNotFoundError, resolve_data

DATA = resolve_data("multihop")


def config(**overrides) -> EnvConfig:
    return EnvConfig(**{"name": "search", "eval_split": "test", "max_turns": 4, **overrides})


@pytest.fixture(scope="module")
def spec():
    return make_env_spec(config())


@pytest.fixture(scope="module")
def env(spec):
    return spec.make()


# ---- action grammar ---------------------------------------------------------------------------


def test_parse_search_action():
    assert parse_search_action("search[Iron Virgin]") == ("search", "Iron Virgin")
    assert parse_search_action("  answer[ Stanley Kubrick ] ") == ("answer", "Stanley Kubrick")
    assert parse_search_action("answer[[1] a list]") == ("answer", "[1] a list")
    for bad in ("search[]", "answer[   ]", "lookup[x]", "Search[x]", "search x", "search[x] and more", ""):
        assert parse_search_action(bad) is None, bad


def test_spec_parse_action(spec):
    assert spec.parse_action("<think>hm</think><action>search[Iron Virgin]</action>").valid
    assert spec.parse_action("<action>answer[Paris]").valid  # stopped at the closing tag
    for bad in ("<action>search[]</action>", "<action>go north</action>", "answer[Paris]"):
        assert not spec.parse_action(bad).valid, bad


# ---- answer scores: hand-worked -----------------------------------------------------------------


def test_squad_normalization():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"  # punctuation dropped, not spaced
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("  U.S.A. ") == "usa"


def test_exact_match_takes_any_alias():
    assert exact_match("the Beatles", ["Beatles"]) == 1.0
    assert exact_match("Capitol", ["Capitol Records", "Capitol"]) == 1.0
    assert exact_match("Capitol Record", ["Capitol Records"]) == 0.0


def test_f1_hand_cases():
    # 'stanley kubrick film' vs 'stanley kubrick': 2 common, P = 2/3, R = 2/2
    # F1 = 2 * (2/3) * 1 / (2/3 + 1) = (4/3) / (5/3) = 0.8
    assert f1_score("Stanley Kubrick film", ["Stanley Kubrick"]) == pytest.approx(0.8)
    # repeated tokens count with multiplicity: 'new new york' vs 'new york': common = min(2,1) + 1 = 2,
    # P = 2/3, R = 1 -> 0.8; against the alias 'york' alone: P = 1/3, R = 1 -> 0.5; best is 0.8
    assert f1_score("new new york", ["york", "New York"]) == pytest.approx(0.8)
    assert f1_score("Paris", ["London"]) == 0.0
    assert f1_score("the", ["a"]) == 0.0  # both normalize to nothing


def test_hotpotqa_f1_zeroes_a_yes_no_mismatch():
    # HotpotQA's f1_score (2WikiMultihopQA's is a copy): 0 when either side normalizes to 'yes', 'no'
    # or 'noanswer' and the two differ; else SQuAD's F1
    # 'yes' vs 'yes no': SQuAD P = 1/1, R = 1/2, F1 = 2 * (1 * 0.5) / 1.5 = 0.667; HotpotQA: 0
    assert f1_score("yes", ["yes no"], "squad") == pytest.approx(2 / 3)
    assert f1_score("yes", ["yes no"], "hotpotqa") == 0.0
    # the answer's side: 'yes it is' vs 'Yes.' -> SQuAD P = 1/3, R = 1, F1 = (2/3) / (4/3) = 0.5; HotpotQA: 0
    assert f1_score("yes it is", ["Yes."], "squad") == pytest.approx(0.5)
    assert f1_score("yes it is", ["Yes."], "hotpotqa") == 0.0
    # 'noanswer' is special too: 'noanswer' vs 'noanswer given' -> SQuAD 2 * (1 * 0.5) / 1.5, HotpotQA 0
    assert token_f1("noanswer", "noanswer given", "squad") == pytest.approx(2 / 3)
    assert token_f1("noanswer", "noanswer given", "hotpotqa") == 0.0
    # equal after normalization: 1 under every rule ('No!' -> 'no')
    for rule in ("squad", "hotpotqa", "musique"):
        assert f1_score("No!", ["no"], rule) == 1.0
        # a span answer: 'stanley kubrick film' vs 'stanley kubrick', P = 2/3, R = 1 -> 0.8 under every rule
        assert f1_score("Stanley Kubrick film", ["Stanley Kubrick"], rule) == pytest.approx(0.8)
    # the best over the aliases: 'yes' scores 0 against 'yes no' and 1 against 'Yes' -> 1
    assert f1_score("yes", ["yes no", "Yes"], "hotpotqa") == 1.0
    assert f1_score("anything", [], "hotpotqa") == 0.0


def test_musique_f1_is_squad_2s_with_empty_answers():
    # MuSiQue's compute_f1: no yes/no rule ('yes' vs 'yes no' stays 2/3), and when a side normalizes
    # to no tokens, 1 if both do ('the' and '$' both normalize to '') else 0
    assert f1_score("yes", ["yes no"], "musique") == pytest.approx(2 / 3)
    assert f1_score("the", ["$"], "musique") == 1.0
    assert f1_score("the", ["$"], "squad") == f1_score("the", ["$"], "hotpotqa") == 0.0
    assert f1_score("the", ["Paris"], "musique") == 0.0
    assert OFFICIAL_F1 == {"hotpotqa": "hotpotqa", "2wiki": "hotpotqa", "musique": "musique"}
    with pytest.raises(ValueError, match="unknown F1 rule 'hotpot'"):
        f1_score("yes", ["yes"], "hotpot")


# ---- corpus and splits --------------------------------------------------------------------------


def test_corpus_holds_golden_and_distractor_passages():
    data = load_multihop(DATA)
    corpus = set(data.passages)
    assert len(corpus) == len(data.passages)  # no duplicates
    assert all(p in corpus for q in data.questions.values() for p in q.golden)
    wiki = json.loads((DATA / "corpus" / "2wikimultihopqa_corpus.json").read_text())
    assert len(data.passages) >= len({(r["title"], r["text"]) for r in wiki})
    assert parse_golden("Gary Groth\n Gary Groth (born 1954) is an editor.").text.startswith("Gary Groth (born")
    assert len(data.questions) == 1500


def test_splits_are_deterministic_and_balanced(spec):
    data = load_multihop(DATA)
    load_multihop.cache_clear()
    assert load_multihop(DATA).splits == data.splits
    test, train = spec.tasks("test"), spec.tasks("train")
    assert len(test) == 300 and len(train) == 1200 and set(test).isdisjoint(train)
    assert [spec.task_type(t) for t in test[:6]] == ["hotpotqa", "2wiki", "musique"] * 2  # round robin
    assert sum(spec.task_type(t) == "musique" for t in test) == 100
    only = make_env_spec(config(task_types=["2wiki"], max_tasks=5)).tasks("test")
    assert len(only) == 5 and all(t.startswith("2wiki/") for t in only)
    with pytest.raises(ValueError, match="unknown search split 'dev'"):
        spec.tasks("dev")
    with pytest.raises(ValueError, match="unknown search task types"):
        make_env_spec(config(task_types=["nq"]))


# ---- the env --------------------------------------------------------------------------------------


def test_search_and_answer(env):
    question = env.data.questions["hotpotqa/0"]
    out = env.reset("hotpotqa/0")
    assert out.observation == f"Question: {question.question}" and out.info["task"] == question.question
    golden = question.golden[0]
    out = env.step(f"search[{golden.title}]")
    lines = out.observation.split("\n")
    assert len(lines) == 3 and all(re.match(rf"Doc {i}\(Title: ", line) for i, line in enumerate(lines, 1))
    assert lines[0] == f"Doc 1(Title: {golden.title}) {golden.text}"
    assert out.info["titles"][0] == golden.title and not out.done
    out = env.step("answer[the FANTAGRAPHICS books!]")  # normalizes to the gold answer
    assert out.done and out.won and out.reward == 1.0 and out.info["f1"] == 1.0
    assert env.step("answer[again]").info["invalid"]


def test_wrong_answer_scores_zero_with_partial_f1(env):
    env.reset("hotpotqa/0")  # gold: 'Fantagraphics Books'
    out = env.step("answer[Fantagraphics Comics]")
    # 1 common token of 2 and 2: P = R = 1/2 -> F1 0.5
    assert out.done and not out.won and out.reward == 0.0 and out.info["score"] == pytest.approx(0.5)


def test_top_k_option(spec):
    env5 = make_env_spec(config(options={"top_k": 5})).make()
    env5.reset("hotpotqa/0")
    assert env5.step("search[comics journal]").observation.count("\nDoc ") == 4
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        make_env_spec(config(options={"top_k": 0}))
    with pytest.raises(ValueError, match="unknown search options"):
        make_env_spec(config(options={"k": 3}))


def test_passage_chars_option_cuts_each_passage_text():
    whole = make_env_spec(config(options={"top_k": 2})).make()
    cut = make_env_spec(config(options={"top_k": 2, "passage_chars": 20})).make()
    for env in (whole, cut):
        env.reset("hotpotqa/0")
    full_lines = whole.step("search[comics journal]").observation.split("\n")
    cut_lines = cut.step("search[comics journal]").observation.split("\n")
    # each line is "Doc i(Title: t) text": the same title, the text's first 20 characters
    for full, short in zip(full_lines, cut_lines, strict=True):
        head, text = full.split(") ", 1)
        assert len(text) > 20 and short == f"{head}) {text[:20]}"
    with pytest.raises(ValueError, match="passage_chars must be a positive integer"):
        make_env_spec(config(options={"passage_chars": 0}))


def answer_scores(env, task: str, answer: str) -> tuple[float, float]:
    env.reset(task)
    out = env.step(f"answer[{answer}]")
    assert out.done and out.info["score"] == out.info["f1"]
    return out.info["em"], out.info["f1"]


def test_f1_rule_option_official_by_dataset_or_squad(env):
    squad = make_env_spec(config(options={"f1_rule": "squad"})).make()
    assert env.f1_rule == "official" and squad.f1_rule == "squad"
    # hotpotqa/1, gold 'yes': 'yes it is' -> EM 0; SQuAD F1 P = 1/3, R = 1 -> 0.5; HotpotQA's rule 0
    assert env.data.questions["hotpotqa/1"].answers == ("yes",)
    assert answer_scores(squad, "hotpotqa/1", "yes it is") == (0.0, pytest.approx(0.5))
    assert answer_scores(env, "hotpotqa/1", "yes it is") == (0.0, 0.0)
    # 2wiki/2, gold 'no': 2WikiMultihopQA's rule is HotpotQA's; 'no' itself scores 1 either way
    assert env.data.questions["2wiki/2"].answers == ("no",)
    assert answer_scores(squad, "2wiki/2", "no way") == (0.0, pytest.approx(2 / 3))
    assert answer_scores(env, "2wiki/2", "no way") == (0.0, 0.0)
    assert answer_scores(env, "2wiki/2", "No.") == (1.0, 1.0)
    # musique/487 accepts '$', which normalizes to nothing: 'the' (also nothing) is an exact match
    # (SQuAD's normalization, every dataset's EM) with MuSiQue's F1 1, SQuAD's 0
    assert "$" in env.data.questions["musique/487"].answers
    assert answer_scores(env, "musique/487", "the") == (1.0, 1.0)
    assert answer_scores(squad, "musique/487", "the") == (1.0, 0.0)
    # a span answer scores the same under both: gold 'Fantagraphics Books', P = R = 1/2 -> 0.5
    assert answer_scores(env, "hotpotqa/0", "Fantagraphics Comics") == answer_scores(
        squad, "hotpotqa/0", "Fantagraphics Comics") == (0.0, pytest.approx(0.5))
    with pytest.raises(ValueError, match="f1_rule must be one of official, squad; got 'hotpotqa'"):
        make_env_spec(config(options={"f1_rule": "hotpotqa"}))


def test_expert_answers_every_test_question_within_four_turns(spec, env):
    won, turns = [], []
    for task in spec.tasks("test"):
        out, expert, taken = env.reset(task), spec.expert(task), 0
        while not out.done and taken < spec.config.max_turns:
            out = env.step(expert.act(out))
            taken += 1
        won.append(out.won)
        turns.append(taken)
    assert len(won) == 300 and all(won) and max(turns) <= 4


@pytest.mark.parametrize("action", [
    "search[" + "x" * 10_000 + "]",
    "",
    "\udcff\x00☃ search 💥",
    "lookup[Paris]",
])
def test_bad_actions_are_invalid(env, action):
    env.reset("2wiki/0")
    start = time.perf_counter()
    out = env.step(action)
    assert time.perf_counter() - start < 1.0
    assert out.info["invalid"] and out.observation == INVALID_MESSAGE and not out.done and out.reward == 0.0


def test_unicode_garbage_query_finds_nothing_without_failing(env):
    env.reset("2wiki/0")
    out = env.step("search[\udcff💥☃]")
    assert not out.info["invalid"] and out.info["titles"] == []


# ---- prompt, data errors, pickling ------------------------------------------------------------------


def test_prompt(spec):
    first = spec.render_prompt(PromptContext(task="Who?", step=0, observation="Question: Who?", history=[]))
    assert "Your question: Who?" in first and "current observation" not in first
    assert "You have 4 step(s) left" in first and "top 3 passages" in first and "<think> </think>" in first
    later = spec.render_prompt(PromptContext(task="Who?", step=2, observation=format_passages([("T", "text")]),
                                             history=[("Doc 1(Title: A) a", "search[b]")], answer_format="action"))
    assert "[Observation 2: 'Doc 1(Title: A) a', Action 2: 'search[b]']" in later
    assert "step 3 and your current observation is: Doc 1(Title: T) text" in later
    assert "You have 2 step(s) left" in later and "<think>" not in later
    with pytest.raises(ValueError, match="unknown prompt template 'fancy'"):
        make_env_spec(config(template="fancy"))


def test_compact_prompt():
    spec = make_env_spec(config(template="compact", options={"top_k": 1}))
    later = spec.render_prompt(PromptContext(task="Who?", step=2, observation="Doc 1(Title: T) text",
                                             history=[("Doc 1(Title: A) a", "search[b]")], answer_format="action"))
    instruction = later.splitlines()[-1]
    assert later == ("Question: Who?\n"
                     "Prior to this step, you have already taken 2 step(s). Below are the most recent 1 observations "
                     "and the corresponding actions you took: [Observation 2: 'Doc 1(Title: A) a', Action 2: 'search[b]']\n"
                     "Result: Doc 1(Title: T) text\n"
                     "Step 3 of 4. Actions: search[<query>] (top 1 passages) or answer[<short answer>] (ends the episode).\n"
                     + instruction)
    assert "<action>" in instruction
    first = spec.render_prompt(PromptContext(task="Who?", step=0, observation="Question: Who?", history=[]))
    assert first.splitlines()[:2] == ["Question: Who?", "Step 1 of 4. Actions: search[<query>] (top 1 passages) or "
                                      "answer[<short answer>] (ends the episode)."]


def test_missing_data_folder_names_where_it_looked(tmp_path, monkeypatch):
    import turnopd.core.data

    monkeypatch.setattr(turnopd.core.data, "data_candidates", lambda recipe_dir=None: [tmp_path])
    with pytest.raises(DataNotFoundError, match=re.escape(str(tmp_path / "multihop"))):
        make_env_spec(config())


def test_incomplete_data_folder_names_the_missing_file(tmp_path):
    (tmp_path / "multihop").mkdir()
    (tmp_path / "multihop" / "hotpotqa.json").write_text("[]")
    with pytest.raises(FileNotFoundError, match="2wiki.json"):
        make_env_spec(config(), data_dir=str(tmp_path))


def test_spec_pickles(spec):
    assert pickle.loads(pickle.dumps(spec)).tasks("test") == spec.tasks("test")
