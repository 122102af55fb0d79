"""Listwise judging, the likelihood-gain judge, judge consensus and cost planning: the pure parts (no engine).

Schema and parser of a scored list, list building (seeded shuffle, chunks, orders), the gain
squashing, Krippendorff's alpha and the consensus rules, the prompt-token plan (`--plan`) on real
MSC data, config validation, and `train --label-weight-by agreement`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from memprune import schema
from memprune.cli import app
from memprune.io import read_table, write_table
from memprune.label import LabelConfig
from memprune.label.agreement import krippendorff_alpha_interval, spearman
from memprune.label.consensus import combine_pairs, consensus_labels
from memprune.label.cost import PromptCounter, plan_mode
from memprune.label.likelihood import gain_to_score
from memprune.label.listwise import build_lists, chunk_group
from memprune.label.pairs import PairOptions, build_pairs, group_bounds, target_groups
from memprune.llm.lists import listwise_schema, parse_listwise


@pytest.fixture(scope="module")
def plan(msc_small: Path):
    return build_pairs(read_table(msc_small / "sessions.parquet", "sessions"),
                       read_table(msc_small / "bullets.parquet", "bullets"), PairOptions())


# ---------------------------------------------------------------- listwise output


def test_listwise_schema_pins_exactly_the_listed_ids():
    s = listwise_schema(3)
    assert s["type"] == "array" and s["items"] is False and s["minItems"] == s["maxItems"] == 3
    assert [item["properties"]["id"] for item in s["prefixItems"]] == [{"const": 1}, {"const": 2}, {"const": 3}]
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, '[{"id": 1, "score": 7}, {"id": 2, "score": 0}, {"id": 3, "score": 10}]')
    for bad in ('[{"id": 1, "score": 7}, {"id": 1, "score": 0}, {"id": 3, "score": 10}]',  # repeated id
                '[{"id": 1, "score": 7}, {"id": 2, "score": 0}]',  # missing id
                '[{"id": 1, "score": 7}, {"id": 2, "score": 0}, {"id": 3, "score": 11}]',  # off the scale
                '[{"id": 1, "score": 7}, {"id": 2, "score": 0}, {"id": 3, "score": 1}, {"id": 4, "score": 1}]'):
        assert not _is_grammar_accept_string(grammar, bad), bad


def test_listwise_parser_strict_lenient_and_errors():
    ok = parse_listwise('[{"id": 2, "score": 10}, {"id": 1, "score": 3}]', 2)
    assert ok.ok and ok.method == "strict" and ok.value == [0.3, 1.0]
    fenced = parse_listwise('Sure!\n```json\n[{"id": "1", "score": 4}, {"id": "2", "score": 6.0}]\n``` done', 2)
    assert fenced.ok and fenced.method == "lenient" and fenced.value == [0.4, 0.6]
    assert parse_listwise('scores: {"1": 2, "2": 9}', 2).value == [0.2, 0.9]
    assert parse_listwise("[5, 7, 0]", 3).value == [0.5, 0.7, 0.0]
    for text, why in (('[{"id": 1, "score": 3}, {"id": 1, "score": 4}]', "twice"),
                      ('[{"id": 1, "score": 3}]', "missing"),
                      ('[{"id": 1, "score": 3}, {"id": 3, "score": 4}]', "not one of the listed ids"),
                      ('[{"id": 1, "score": 30}, {"id": 2, "score": 4}]', "0..10"),
                      ("no idea", "no JSON list"), ("", "empty")):
        parsed = parse_listwise(text, 2)
        assert not parsed.ok and why in parsed.error, (text, parsed.error)


# ---------------------------------------------------------------- lists


def test_lists_are_seeded_shuffles_cut_into_chunks_and_mirrored_orders(plan):
    groups = target_groups(plan)
    turns = plan.pairs.column("turn_id").to_pylist()
    assert all(len({turns[p] for p in range(a, b)}) == 1 for a, b in groups)
    assert sum(b - a for a, b in groups) == plan.pairs.num_rows and len({turns[a] for a, _ in groups}) == len(groups)
    lists = build_lists(plan, groups, seed=0, max_bullets=4, orders=2)
    assert build_lists(plan, groups, seed=0, max_bullets=4, orders=2) == lists  # deterministic
    other = build_lists(plan, groups, seed=1, max_bullets=4, orders=2)
    assert [x.positions for x in other] != [x.positions for x in lists]  # the seed changes the order
    by_chunk: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
    for lst in lists:
        assert 1 <= len(lst.positions) <= 4
        by_chunk.setdefault((lst.group, lst.chunk), {})[lst.order] = lst.positions
    for (g, _), orders in by_chunk.items():
        assert orders[1] == tuple(reversed(orders[0]))
        a, b = groups[g]
        assert set(orders[0]) <= set(range(a, b))
    for g, (a, b) in enumerate(groups):  # every pair of a turn is in exactly one chunk
        got = sorted(p for (gg, _), o in by_chunk.items() if gg == g for p in o[0])
        assert got == list(range(a, b))
    # shuffled: the first shown bullet is not always the first in the plan
    assert any(o[0][0] != groups[g][0] for (g, _), o in by_chunk.items())
    # a token budget cuts chunks too; a bullet that fits nowhere gets its own chunk
    assert chunk_group([1, 2, 3, 4, 5], 10, lambda ps: len(ps) <= 2) == [[1, 2], [3, 4], [5]]
    assert chunk_group([1, 2], 10, lambda ps: False) == [[1], [2]]
    assert group_bounds([(0, 3), (3, 4), (4, 9), (9, 10)], 4) == [(0, 4), (4, 9), (9, 10)]


# ---------------------------------------------------------------- likelihood and consensus maths


def test_gain_squashing_is_monotone_and_documented():
    g = np.array([-1.0, -0.1, 0.0, 0.05, 0.25, 1.0, np.nan])
    t = gain_to_score(g, "tanh", 0.25)
    assert t[:3].tolist() == [0.0, 0.0, 0.0] and t[4] == pytest.approx(np.tanh(1.0)) and np.isnan(t[-1])
    s = gain_to_score(g, "sigmoid", 0.25)
    assert s[2] == 0.5 and np.all(np.diff(s[:-1]) > 0) and np.all(np.diff(t[:-1]) >= 0)
    assert ((t[:-1] >= 0) & (t[:-1] <= 1)).all() and ((s[:-1] > 0) & (s[:-1] < 1)).all()
    with pytest.raises(ValueError):
        gain_to_score(g, "relu")


def test_krippendorff_alpha_interval_matches_the_published_example():
    # Krippendorff (2011), "Computing Krippendorff's alpha-reliability": 4 observers x 12 units, interval alpha 0.849
    n = np.nan
    data = np.array([[1, 2, 3, 3, 2, 1, 4, 1, 2, n, n, n], [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, n, 3],
                     [n, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, n], [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, n]]).T
    assert krippendorff_alpha_interval(data) == pytest.approx(0.849, abs=5e-4)
    assert krippendorff_alpha_interval(np.array([[0.2, 0.2], [0.9, 0.9], [0.5, 0.5]])) == pytest.approx(1.0)
    assert krippendorff_alpha_interval(np.array([[1.0, n], [n, 2.0]])) is None  # nothing pairable
    assert spearman(np.array([1, 2, 3, 4.0]), np.array([10, 20, 30, 41.0])) == pytest.approx(1.0)
    assert spearman(np.array([1, 2, n, 4.0]), np.array([4, 3, 2, 1.0])) == pytest.approx(-1.0)


def test_consensus_mean_spread_agreement_and_failed_bullets():
    scores = np.array([[0.2, 0.8, np.nan, np.nan], [0.4, 0.8, 0.6, np.nan]])
    c = combine_pairs(scores, [[None, None, "boom", "x"], [None, None, None, "y"]])
    assert c["score"][:3].tolist() == pytest.approx([0.3, 0.8, 0.6]) and np.isnan(c["score"][3])
    assert c["n_judges"].tolist() == [2, 2, 1, 0] and c["spread"][:3].tolist() == pytest.approx([0.1, 0.0, 0.0])
    assert c["error"] == [None, None, None, "x | y"]
    pairs = pa.table({"bullet_id": ["a", "a", "b", "c"], "horizon": pa.array([1, 1, 1, 1], pa.int32())})
    labels, failed, matrix, ids = consensus_labels(pairs, scores, decay=0.5, how="max")
    got = {r["bullet_id"]: r for r in labels.to_pylist()}
    # a: judge 0 max 0.8, judge 1 max 0.8 -> agree; b: only judge 1 labels it
    assert got["a"]["label"] == pytest.approx(0.8) and got["a"]["agreement"] == pytest.approx(1.0)
    assert got["a"]["n_judges"] == 2 and got["a"]["n_pairs"] == 2
    assert got["b"]["n_judges"] == 1 and got["b"]["spread"] == 0.0 and got["b"]["n_pairs"] == 1
    assert failed == [{"bullet_id": "c", "reason": "all_pairs_failed", "n_pairs": 1, "n_errors": 1}]
    assert ids == ["a", "b", "c"] and matrix.shape == (3, 2)
    schema.validate_table(labels, "labels")
    split = consensus_labels(pa.table({"bullet_id": ["a"], "horizon": pa.array([1], pa.int32())}),
                             np.array([[0.0], [1.0]]), 0.5, "max")[0].to_pylist()[0]
    assert split["label"] == 0.5 and split["spread"] == 0.5 and split["agreement"] == 0.0


# ---------------------------------------------------------------- cost planning


def test_plan_counts_match_whole_prompt_tokenization(plan, tiny_llm: str):
    from memprune.label.config import CostOptions, ListwiseOptions
    from memprune.label.cost import PromptStats
    from memprune.label.llm_judge import pairwise_prompts
    from memprune.llm import load_template

    counter = PromptCounter(tiny_llm)
    assert "judge model's tokenizer" in counter.name and counter.chat
    texts = list(pairwise_prompts(plan, target_groups(plan), counter, load_template("judge_v1", "judge")))
    assert len(texts) == plan.pairs.num_rows and all("<|assistant|>" in t for t in texts)
    exact = counter.count_exact(texts).sum()
    assert abs(counter.count(texts).sum() - exact) / exact < 0.01  # line-by-line counting is (near) exact
    stats = PromptStats(counter, 16)
    for t in texts[:3]:
        stats.add(t)
    assert stats.calls == 3 and 0 < stats.reusable < stats.tokens and stats.reusable % 16 == 0

    # a prompt budget cuts lists into chunks that fit: every chunk's prompt counts at most the budget
    from memprune.label.listwise import list_budget, listwise_prompts

    groups = target_groups(plan)
    template = load_template("judge_listwise_v1", "listwise")
    whole = build_lists(plan, groups, 0, 20, 1)
    sizes = counter.count(list(listwise_prompts(plan, whole, groups, counter, template)))
    budget = int(np.median(sizes))  # about half of the turns' lists no longer fit whole
    fits = list_budget(plan, groups, counter, template, budget, None, 16)
    cut = build_lists(plan, groups, 0, 20, 1, fits)
    assert len(cut) > len(whole)
    cut_sizes = counter.count(list(listwise_prompts(plan, cut, groups, counter, template)))
    over = [len(lst.positions) for lst, n in zip(cut, cut_sizes) if n > budget + 2]  # estimate: within a token or two
    assert all(k == 1 for k in over)  # only a bullet whose turn alone is over the budget stands over it

    cost = CostOptions(throughput=1000.0, decode_throughput=100.0)
    modes = {m: plan_mode(m, plan, counter, None, ListwiseOptions(), cost) for m in ("pairwise", "listwise", "likelihood")}
    pw, lw, lk = modes["pairwise"], modes["listwise"], modes["likelihood"]
    assert pw["calls"] == plan.pairs.num_rows and pw["prompt_tokens"] == counter.count(texts).sum()
    assert lw["calls"] == len(target_groups(plan)) and lk["calls"] == plan.pairs.num_rows + lw["calls"]
    assert lw["prompt_tokens_per_pair"] < pw["prompt_tokens_per_pair"] / 3
    assert 0.5 < pw["prefix_cache_reusable_share"] < 1 and lk["prefix_cache_reusable_share"] == 0
    assert not lk["prefix_cache_used"] and lk["generated_tokens"] == lk["calls"]
    for m in modes.values():
        uncached = m["effective_tokens"] - m["generated_tokens"]
        assert m["gpu_hours"] == pytest.approx((uncached / 1000 + m["generated_tokens"] / 100) / 3600)


def test_cli_plan_on_msc_shows_the_listwise_saving(msc_small: Path, tmp_path: Path):
    res = CliRunner().invoke(app, ["label", "--data", str(msc_small), "--out", str(tmp_path), "--plan",
                                   "--judge", "llm", "--judge-mode", "listwise", "--throughput", "2500"])
    assert res.exit_code == 0, res.output
    assert "| listwise (chosen) |" in res.output and "GPU-hours @ 2500 / 2500 tok/s" in res.output
    plan_json = json.loads((tmp_path / "plan.json").read_text())
    assert plan_json["tokenizer"].startswith("all-MiniLM-L6-v2 (fallback: no judge model given")
    assert plan_json["listwise_saving"] >= 5.0  # the bar: at least 5x fewer prompt tokens per pair
    assert (tmp_path / "plan.md").read_text().startswith("# Labeling plan")
    assert not (tmp_path / "pairs.parquet").exists()  # nothing was judged


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize("values, message", [
    ({"judge": "similarity", "judge_mode": "listwise"}, "judge_mode=listwise needs judge=llm"),
    ({"judge": "llm", "judge_mode": "listwise", "order": "bullet", "llm": {"engine": "hf", "model": "m"}},
     "set order=target"),
    ({"judge": "llm", "judge_samples": 3, "judge_set": ["a.yaml"]}, "either judge_set"),
    ({"judge": "likelihood", "judge_samples": 2, "llm": {"engine": "hf", "model": "m"}}, "deterministic"),
    ({"judge": "llm", "judge_set": ["/nonexistent/judge.yaml"]}, "/nonexistent/judge.yaml: no such LLM config"),
    ({"judge": "likelihood"}, "judge=likelihood needs an LLM config"),
])
def test_label_config_names_the_problem(values: dict, message: str):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LabelConfig(data="d", out="o", **values)


def test_likelihood_needs_an_engine_with_prompt_logprobs(tiny_llm: str):
    from memprune.llm import LLMConfig, LLMError
    from memprune.llm.loglik import run_loglik

    config = LLMConfig(engine="http", model="tiny", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(LLMError, match="engine hf or vllm"):
        run_loglik(None, config)


# ---------------------------------------------------------------- training weights


def test_train_weighs_rows_by_agreement(tmp_path: Path):
    from memprune.label.consensus import LABELS_CONSENSUS
    from memprune.rejects import Ledger
    from memprune.train.config import TrainConfig, TrainError
    from memprune.train.data import load_labels

    rows = [{"bullet_id": b, "label": 0.5, "n_pairs": 1, "aggregation": "max", "source": "judge", "n_judges": 2,
             "spread": s, "agreement": 1 - 2 * s} for b, s in (("a", 0.0), ("b", 0.25), ("c", 0.5))]
    (tmp_path / "cons").mkdir()
    write_table(pa.Table.from_pylist(rows, schema=LABELS_CONSENSUS), tmp_path / "cons" / "labels.parquet", "labels")
    plain = [{k: r[k] for k in ("bullet_id", "label", "n_pairs", "aggregation", "source")} for r in rows]
    (tmp_path / "plain").mkdir()
    write_table(pa.Table.from_pylist(plain, schema=schema.LABELS), tmp_path / "plain" / "labels.parquet", "labels")

    def weights(labels: str, **kw) -> dict[str, float]:
        cfg = TrainConfig(data=tmp_path, labels=[tmp_path / labels], out=tmp_path / "o", **kw)
        table, counts = load_labels(cfg, {"a", "b", "c"}, Ledger(None))
        return dict(zip(table.column("bullet_id").to_pylist(), table.column("weight").to_pylist()))

    assert weights("cons") == {"a": 1.0, "b": 1.0, "c": 1.0}  # off by default
    assert weights("cons", label_weight_by="agreement") == pytest.approx({"a": 1.0, "b": 0.55, "c": 0.1})
    assert weights("cons", label_weight_by="agreement", agreement_floor=0.5,
                   label_weights={"judge": 2.0}) == pytest.approx({"a": 2.0, "b": 1.5, "c": 1.0})
    with pytest.raises(TrainError, match="no label table has an `agreement` column"):
        weights("plain", label_weight_by="agreement")


# ---------------------------------------------------------------- the judge registry


def test_every_judge_kind_is_one_registry_entry_selected_by_the_settings():
    from pydantic import ValidationError

    from memprune.label.config import LabelSettings
    from memprune.label.judges import JUDGES, plan_modes

    assert list(JUDGES) == ["similarity", "pairwise", "listwise", "likelihood"]
    with pytest.raises(ValidationError, match="judge=nope, judge_mode=pairwise: no such judge; the judges: similarity"):
        LabelSettings(judge="nope")
    for kind, entry in JUDGES.items():
        settings = LabelSettings(judge=entry.judge, judge_mode=entry.judge_mode, plan=True)
        assert settings.judge_entry() is entry and entry.judge_all is not None
        assert (entry.run is None) == (not entry.needs_llm) and (entry.plan is None) == (entry.task is None)
    assert plan_modes() == ("pairwise", "listwise", "likelihood")
