"""The HTTP schema of the service (pydantic; FastAPI serves it as OpenAPI at /docs). Pure: no Ray, no torch."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from memprune.texts import check_text

Text = Annotated[str, AfterValidator(check_text)]  # a lone surrogate: 422 for that request


RULE = ("a pruning rule, flat as in YAML (policy: budget, budget_tokens: 120, ...): the policy and its numbers, "
        "min_keep, floor, dedup, dedup_threshold, group_by, pin_field, retention {half_life, recall_boost, max_age, "
        "now}, supersede {judge (one the server allows), scope, subject, low, high}; anything else is refused (400). "
        "null: the server's rule")


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScoreRequest(Request):
    texts: list[Text] = Field(min_length=1, description="texts to score")


class ScoreResponse(BaseModel):
    raw: list[float]
    calibrated: list[float] | None = Field(description="P(relevant); null when the scorer has no calibration")


class Bullet(Request):
    id: str | None = Field(None, description="the bullet's id (default: its position)")
    text: Text
    time: float | str | None = Field(None, description="epoch seconds or an ISO time (retention, expiry)")
    pinned: bool | None = Field(None, description="read when the rule's pin_field is 'pinned'")
    metadata: dict[str, Any] | None = Field(None, description="echoed nowhere; pin_field may name one of its keys")

    def mapping(self) -> dict[str, Any]:
        """The bullet as `MemoryPruner` takes it: text, and time / pinned / metadata keys where given."""
        out: dict[str, Any] = {**(self.metadata or {}), "text": self.text}
        if self.time is not None:
            out["time"] = self.time
        if self.pinned is not None:
            out["pinned"] = self.pinned
        return out


class DecideRequest(Request):
    bullets: list[Bullet] = Field(min_length=1, description="one group's bullets, oldest first")
    rule: dict[str, Any] | None = Field(None, description=RULE)

    @field_validator("bullets")
    @classmethod
    def _unique_ids(cls, v: list[Bullet]) -> list[Bullet]:
        seen: set[str] = set()
        for i, b in enumerate(v):
            if b.id is not None:
                if b.id in seen:
                    raise ValueError(f"bullets[{i}]: id {b.id!r} given twice")
                seen.add(b.id)
        return v


class Verdict(BaseModel):
    id: str
    keep: bool
    reason: str | None = Field(description="why it goes (below_threshold, over_top_k, over_budget, duplicate, ...)")
    score: float
    duplicate_of: str | None = Field(None, description="the id of the bullet it duplicates")
    superseded_by: str | None = Field(None, description="with supersession: the id of the later bullet that updates it")
    effective_score: float | None = Field(None, description="with retention: score x retention")
    retention: float | None = Field(None, description="with retention: the bullet's retention factor")


class DecideResponse(BaseModel):
    rule: str = Field(description="the rule in words")
    score: str = Field(description="raw or calibrated: which scores the rule saw")
    columns: list[str] = Field(description="the decision's columns in MemoryPruner.prune_table's order "
                                           "(effective_score and retention with retention, superseded_by with "
                                           "supersession)")
    decisions: list[Verdict]


class PruneRequest(Request):
    store: str = Field(description="the name of a store in the server's config (never a path)")
    group: str = Field(min_length=1, description="the group id (a Mem0 user_id)")
    rule: dict[str, Any] | None = Field(None, description=RULE)
    apply: bool = Field(False, description="archive then delete the dropped records (bearer token required); "
                                           "false: a dry run")
    review: bool = Field(False, description="also write the decision's review page (every record, kept or why it "
                                            "goes, what replaced it) and answer its address in `review`")


class Skipped(BaseModel):
    id: str
    why: str = Field(description="changed since the decision (its text), or removed since the decision")


class PruneResponse(BaseModel):
    store: str
    group: str
    applied: bool
    kept: int
    dropped: int
    archive: str | None = Field(None, description="the archive written (`memprune restore ARCHIVE` puts it back)")
    skipped: list[Skipped] = Field(default_factory=list, description="dropped records that apply left alone: "
                                   "someone changed or removed them between the decision and the apply")
    decisions: list[Verdict]
    review: str | None = Field(None, description="with `review`: the page's path on this server (GET it; the "
                                                 "address is unguessable; the newest review_keep pages of a store are kept)")


class ErrorResponse(BaseModel):
    error: str = Field(description="one line saying what is wrong")
