"""A request's rule is data (issue 56, item 1): the fields a client may set, refused in one line naming the field
before anything reads them; an LLM update judge only with the server's own LLM settings. Pure: no Ray."""

from __future__ import annotations

import pytest

from memprune.decision import UPDATE_JUDGES, PruneRule, Retention, Supersede
from memprune.serve import ServeConfig
from memprune.serve.rules import SECTIONS, SERVER_ONLY, SHARED, RuleRefused, check_request_rule, request_rule

JUDGES = frozenset({"slot"})


def test_every_rule_field_is_either_a_request_field_or_the_servers() -> None:
    """A new field of the rule must be placed on one side: nothing reaches a request by default."""
    sections = {"retention": Retention, "supersede": Supersede}
    assert set(PruneRule.model_fields) == SHARED | set(sections)
    for name, model in sections.items():
        assert set(model.model_fields) == SECTIONS[name] | SERVER_ONLY.get(name, frozenset()), name


@pytest.mark.parametrize(("rule", "field"), [
    ({"supersede": {"judge": "llm", "llm": {"engine": "http", "base_url": "http://127.0.0.1:9",
                                            "api_key_env": "MEMPRUNE_SERVE_TOKEN", "model": "m"}}},
     "rule.supersede.llm"),
    ({"supersede": {"judge": "llm", "llm_config": "/etc/passwd"}}, "rule.supersede.llm_config"),
    ({"supersede": {"judge": "llm"}}, "rule.supersede.judge"),
    ({"supersede": {"judge": "slot", "subject": {"engine": "http"}}}, "rule.supersede.subject"),
    ({"usage_log": "/etc/passwd"}, "rule.usage_log"),
    ({"tokenizer": "/etc/passwd"}, "rule.tokenizer"),
    ({"retention": {"half_life": 30, "usage_log": "/tmp/x"}}, "rule.retention.usage_log"),
    ({"retention": "/etc/passwd"}, "rule.retention"),
    ({"threshold": {"path": "/etc/passwd"}}, "rule.threshold"),
    ({"policy": ["budget"]}, "rule.policy"),
])
def test_a_request_naming_a_server_resource_is_refused_naming_the_field(rule: dict, field: str) -> None:
    with pytest.raises(RuleRefused) as err:
        request_rule(rule, PruneRule(), JUDGES)
    message = str(err.value)
    assert message.startswith(field + ":") and "\n" not in message
    assert "root:" not in message and "top level" not in message  # nothing was read


def test_what_a_request_may_set_is_the_rule_it_gets() -> None:
    rule = {"policy": "budget", "budget_tokens": 40, "min_keep": 0, "floor": 0.1, "dedup": False, "group_by": "speaker",
            "pin_field": "starred", "retention": {"half_life": 30, "max_age": 365, "now": "2025-01-01T00:00:00Z"},
            "supersede": {"judge": "slot", "scope": "session", "subject": "user", "low": 0.35}}
    got = request_rule(rule, PruneRule(), JUDGES)
    assert got == PruneRule.of(**rule)
    assert request_rule(None, PruneRule.of(top_k=2), JUDGES) == PruneRule.of(top_k=2)


def test_an_llm_judge_comes_only_from_the_servers_rule(tmp_path) -> None:
    llm = tmp_path / "llm.yaml"
    llm.write_text("engine: http\nmodel: judge\nbase_url: http://127.0.0.1:9/v1\n")
    server = PruneRule.of(supersede={"judge": "llm", "llm_config": str(llm)})
    cfg = ServeConfig(scorer="s", rule=server)
    no_llm = {n for n, e in UPDATE_JUDGES.items() if not e.needs_llm}  # "slot", and any a test registered
    assert "slot" in no_llm and cfg.allowed_judges() == no_llm | {"llm"}
    got = request_rule({"top_k": 2, "supersede": {"judge": "llm", "scope": "session"}}, server, cfg.allowed_judges())
    assert got.supersede.llm_config == str(llm.resolve()) and got.supersede.scope == "session"
    assert ServeConfig(scorer="s").allowed_judges() == no_llm
    with pytest.raises(ValueError, match="judges: 'llm' needs an LLM, which only the server's rule configures"):
        ServeConfig(scorer="s", judges=["slot", "llm"])
    assert ServeConfig(scorer="s", judges=[]).allowed_judges() == frozenset()
    with pytest.raises(RuleRefused, match=r"rule.supersede.judge: 'slot' is not an update judge this server allows"):
        check_request_rule({"supersede": {"judge": "slot"}}, frozenset())
