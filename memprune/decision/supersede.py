"""Supersession: a later bullet that updates an earlier one of the same subject supersedes it (reason `superseded`).

A step of the one decision (`memprune.decision.decide`), after duplicate merging and before expiry, the floor
and the policy. It works within a *scope* (`Supersede.scope`: the conversation (a store's user) by default,
or the session), separate from the policy's group because updates cross sessions. Among the scope's bullets
of one subject (`Supersede.subject`, e.g. `speaker`) that represent their duplicate cluster:

1. **candidates**: pairs whose cosine (the scorer's own embeddings) lies in the band [low, high), below the
   duplicate threshold, ordered in time: by the bullets' times when both are known and differ, else by
   their session order when both are known and differ; equal or unknown times are never guessed (no pair);
2. **the update judge** (`memprune.decision.updates.UPDATE_JUDGES`) says of each pair whether B updates A;
3. the earlier A of each accepted pair goes, `superseded_by` = the latest B that updates it; so does an earlier
   restatement of A (cosine >= high: the same fact stated again in another session, which the judge never
   sees), transitively. A pinned bullet is never superseded (it can still supersede an older one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict, Field, field_validator, model_validator

from memprune.config import ConfigModel
from memprune.decision.bullets import Bullets
from memprune.decision.updates import NO_VERDICT, Pairs, update_judge
from memprune.llm import LLMConfig

SUPERSEDED = "superseded"
JUDGED = ("supersede_pairs", "supersede_updates", "supersede_no_verdict")  # the judge's counters (prune.json)
SCOPE_KEYS: dict[str, tuple[str, ...]] = {"conversation": ("conversation_id",),
                                          "session": ("conversation_id", "session_index")}


class Supersede(ConfigModel):
    """The supersession step's settings (`PruneRule.supersede`); off unless `judge` names an update judge."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    judge: str | None = Field(None, description="the update judge (memprune.decision.updates); null = no supersession")
    scope: Literal["conversation", "session"] = Field(
        "conversation", description="where an update can supersede: the conversation (a store's user) or the session")
    subject: str = Field("speaker", min_length=1, description="column (mapping key) of whom a fact is about")
    low: float = Field(0.3, ge=-1.0, le=1.0, description="candidate pairs: cosine >= low")
    high: float | None = Field(None, ge=-1.0, le=1.0,
                               description="... and cosine < high (default: the dedup threshold)")
    llm_config: str | None = Field(None, description="judge llm: a YAML file of memprune.llm.LLMConfig fields")
    llm: dict[str, Any] | None = Field(None, description="judge llm: LLMConfig fields inline (merged over llm_config)")

    @field_validator("judge")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None:
            update_judge(v)
        return v

    @field_validator("llm_config")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:  # workers may run in another directory
        return None if v is None else str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _llm(self) -> "Supersede":
        """A judge that needs an LLM has a valid LLM config whose model is there (read once, before any work)."""
        given = self.llm_config is not None or self.llm is not None
        needs = self.judge is not None and update_judge(self.judge).needs_llm
        if needs and not given:
            raise ValueError(f"update judge {self.judge!r} needs an LLM config: set supersede.llm_config (a YAML "
                             "file, --supersede-llm FILE) or an inline supersede.llm section")
        if given and not needs:
            raise ValueError(f"supersede.llm_config / supersede.llm configure an LLM update judge (llm), but the judge "
                             f"is {self.judge!r}")
        if needs:
            self.llm_settings().check_model()
        return self

    def llm_settings(self) -> LLMConfig:
        """The LLM config of an LLM update judge: `llm_config`, then the inline `llm` fields."""
        return LLMConfig.resolve(self.llm_config, self.llm, None)

    @model_validator(mode="after")
    def _band(self) -> "Supersede":
        if self.high is not None and self.high <= self.low:
            raise ValueError(f"the similarity band is empty: low {self.low:g} >= high {self.high:g}")
        return self

    @property
    def on(self) -> bool:
        return self.judge is not None

    @property
    def keys(self) -> tuple[str, ...]:
        """The columns whose values form a scope."""
        return SCOPE_KEYS[self.scope]

    def band(self, dedup_threshold: float) -> tuple[float, float]:
        return self.low, self.high if self.high is not None else dedup_threshold

    def describe(self, dedup_threshold: float) -> str:
        lo, hi = self.band(dedup_threshold)
        llm = self.llm_config is not None or self.llm is not None
        judge = f"{self.judge} ({self.llm_settings().describe('update')})" if llm else self.judge
        return (f"a later bullet of the same {self.subject} that updates an earlier one supersedes it within the "
                f"{self.scope} (judge {judge}, cosine in [{lo:g}, {hi:g}))")


def later(time: np.ndarray, session: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """+1 where bullet j is later than i, -1 where earlier, 0 where it cannot be told (equal or unknown)."""
    ti, tj, si, sj = time[i], time[j], session[i], session[j]
    by_time = ~np.isnan(ti) & ~np.isnan(tj)
    out = np.where(by_time, np.sign(np.nan_to_num(tj - ti)), 0)
    by_session = ~by_time & ~np.isnan(si) & ~np.isnan(sj)
    return np.where(by_session, np.sign(np.nan_to_num(sj - si)), out).astype(np.int64)


def candidates(bullets: Bullets, band: tuple[float, float], duplicate_of: np.ndarray | None,
               pinned: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidate pairs (A earlier, B later, their cosine): same scope and subject, both representatives, cosine in
    the band, time order known, A not pinned."""
    scope, subject, time, session = bullets.scope, bullets.subject or [], bullets.when, bullets.session
    n = len(bullets)
    time = np.full(n, np.nan) if time is None else time
    session = np.full(n, np.nan) if session is None else session
    emb = np.asarray(bullets.embeddings, dtype=np.float32)
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    rep = np.ones(n, dtype=bool) if duplicate_of is None else np.asarray(duplicate_of) < 0
    free = ~np.asarray(pinned, dtype=bool)
    subj: dict[Any, int] = {}
    part = np.fromiter((subj.setdefault((int(c), s), len(subj)) if s is not None else -1
                        for c, s in zip(scope, subject)), dtype=np.int64, count=n)
    lo, hi = band
    ai, bi, cos = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.float32)]
    valid = rep & (part >= 0)
    order = np.flatnonzero(valid)[np.argsort(part[valid], kind="stable")]
    for idx in np.split(order, np.flatnonzero(np.diff(part[order])) + 1):
        if len(idx) < 2:
            continue
        for first in range(0, len(idx), 1024):  # row chunks bound the memory of a large scope (a store's user)
            sim = emb[idx[first:first + 1024]] @ emb[idx].T
            r, j = np.nonzero((sim >= lo) & (sim < hi))
            upper = first + r < j
            r, j = r[upper], j[upper]
            s = sim[r, j]
            i, j = idx[first + r], idx[j]
            d = later(time, session, i, j)
            a, b = np.where(d > 0, i, j), np.where(d > 0, j, i)
            keep = (d != 0) & free[a]
            ai.append(a[keep])
            bi.append(b[keep])
            cos.append(s[keep])
    return np.concatenate(ai), np.concatenate(bi), np.concatenate(cos)


def find_superseded(bullets: Bullets, settings: Supersede, band: tuple[float, float], duplicate_of: np.ndarray | None,
                    pinned: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
    """Index of the bullet that supersedes each bullet (-1: none), see the module docstring; and the judge's counts
    (`JUDGED`: pairs judged, updates found, pairs without a verdict (an LLM answer that never parsed)). `band`: the
    candidates' cosines (`settings.band(dedup_threshold)`)."""
    n = len(bullets)
    out = np.full(n, -1, dtype=np.int64)
    counts = dict.fromkeys(JUDGED, 0)
    if n < 2:
        return out, counts
    if bullets.embeddings is None:
        raise ValueError("supersession needs the scorer's embeddings (a scorer with embed())")
    # one pass over the pairs: those in the band go to the judge, those above it are restatements (below)
    pa_, pb, c = candidates(bullets, (band[0], np.inf), duplicate_of, pinned)
    judged = c < band[1]
    a, b, c = pa_[judged], pb[judged], c[judged]
    if not len(a):
        return out, counts
    entry = update_judge(str(settings.judge))
    texts, emb = bullets.texts, np.asarray(bullets.embeddings)
    verdict = np.asarray(entry.judge(Pairs([texts[k] for k in a], [texts[k] for k in b], c, bullets.encode, emb[a],
                                           emb[b]), settings), dtype=np.int64)
    counts.update(supersede_pairs=len(a), supersede_updates=int((verdict > 0).sum()),
                  supersede_no_verdict=int((verdict == NO_VERDICT).sum()))
    a, b = a[verdict > 0], b[verdict > 0]
    time = np.full(n, np.nan) if bullets.when is None else bullets.when
    session = np.full(n, np.nan) if bullets.session is None else bullets.session
    for k in np.lexsort((b, np.nan_to_num(session[b], nan=-np.inf), np.nan_to_num(time[b], nan=-np.inf))):
        out[a[k]] = b[k]  # in time order: the latest B that updates A wins
    # an earlier restatement of a superseded fact (cosine >= high: the same fact in another session) goes with it
    r, r2 = pa_[~judged], pb[~judged]
    while len(r):
        move = (out[r] < 0) & (out[r2] >= 0)
        if not move.any():
            break
        out[r[move]] = out[r2[move]]
    return out, counts
