"""The service's config, validated once: the scorer, where it listens, its stores, replicas, batching, limits."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from memprune.config import ConfigModel
from memprune.precision import Precision, precision_field
from memprune.scorers import ScorerRef, declared_threshold, scorer_field
from memprune.decision import PruneRule
from memprune.decision.updates import UPDATE_JUDGES, update_judge

STORE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # what a configured store may be called


class ServedStore(ConfigModel):
    """A store /v1/prune may read or change: where it is and how its columns map (as `memprune prune --input
    LOCATION --map ...`: time for recency, retention and supersession; pin for the records never dropped)."""

    location: str = Field(description="KIND:LOCATION (mem0:CONFIG.yaml, lance:DIR, table:FILE)")
    map: dict[str, str] = Field(default_factory=dict, description="field -> column (Mem0: metadata key): id, text, "
                                "group, time, pin; unset fields take the kind's default (pin: none)")

    @field_validator("location")
    @classmethod
    def _location(cls, v: str) -> str:
        from memprune.stores import split_input

        if split_input(v) is None:
            raise ValueError(f"{v!r} is not KIND:LOCATION (mem0:, lance:, table:)")
        return v

    @field_validator("map")
    @classmethod
    def _map(cls, v: dict[str, str]) -> dict[str, str]:
        from memprune.stores.config import check_map

        return check_map(v)

    def open(self) -> Any:
        """The store, opened with its mapping (a mapped column it lacks is a `StoreError`)."""
        from memprune.stores import open_store, split_input

        kind, where = split_input(self.location)  # type: ignore[misc]  (validated)
        return open_store(kind, where, self.map)


class ServeConfig(ConfigModel):
    """`memprune serve`: one scorer, the stores clients may name, and the bounds of every request."""

    scorer: ScorerRef = scorer_field()
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface; set a token first)")
    port: int = Field(8000, ge=1, le=65535)
    stores: dict[str, ServedStore] = Field(default_factory=dict,
                                           description="name -> KIND:LOCATION, or {location: KIND:LOCATION, map: "
                                                       "{time: COL, pin: COL, ...}}: the only stores /v1/prune reads or "
                                                       "changes; clients send the name")
    archive_dir: str = Field("serve-archive", description="where /v1/prune with apply writes its archives "
                                                          "(ARCHIVE_DIR/STORE/...; `memprune restore` takes one)")
    review_dir: str = Field("serve-reviews", description="where /v1/prune with review writes its pages "
                                                         "(REVIEW_DIR/STORE/ID/review.html, served at /v1/review/STORE/ID/; "
                                                         "the newest review_keep per store are kept)")
    review_keep: int = Field(100, ge=1, description="review pages kept per store (older ones are removed)")
    rule: PruneRule = Field(default_factory=PruneRule, description="the rule of a request that names none")
    judges: list[str] | None = Field(None, description="update judges a request's rule may name (supersede.judge); "
                                     "null: those that need no LLM, plus the judge of the server's rule. An LLM judge "
                                     "runs with the server rule's LLM settings only: a request never names an engine, "
                                     "model, URL, key or file")
    score: Literal["auto", "raw", "calibrated"] = Field("auto", description="which scores the rule sees (as prune's)")
    tokenizer: str = Field("encoder", description="token unit of the budget policy (as prune's)")
    precision: Precision = precision_field("of the scorer's forward passes")
    device: str = Field("auto", description="torch device of each replica: auto (cuda when it has a GPU), cpu, cuda")
    replicas: int = Field(1, ge=1, description="replicas when not autoscaling")
    min_replicas: int | None = Field(None, ge=0, description="autoscaling lower bound (with max_replicas)")
    max_replicas: int | None = Field(None, ge=1, description="autoscaling upper bound; null = a fixed replica count")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica (also its torch threads, rounded up)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica")
    batch_size: int = Field(64, ge=1, description="encoder forward batch size")
    batch_max_size: int = Field(32, ge=1, description="most requests whose texts share one encoder call")
    batch_wait_s: float = Field(0.005, ge=0, description="how long a request that finds the encoder idle waits for "
                                                         "others to share its call")
    max_ongoing_requests: int = Field(64, ge=1, description="requests a replica holds at once")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="a bigger request body is refused (413)")
    max_bullets: int = Field(1000, ge=1, description="most bullets (texts) in one request")
    max_text_chars: int = Field(10_000, ge=1, description="most characters in one bullet text")
    token_env: str = Field("MEMPRUNE_SERVE_TOKEN", description="environment variable (on the server) holding the bearer "
                                                               "token that apply requires; unset: apply is refused")
    ray_address: str | None = None
    block: bool = Field(True, description="`memprune serve` waits (Ctrl-C stops the app); false: returns once up")

    @field_validator("stores", mode="before")
    @classmethod
    def _stores(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        for name in v:
            if not STORE_NAME.match(str(name)):
                raise ValueError(f"store name {name!r}: letters, digits, '_' and '-' only (at most 64)")
        return {name: {"location": s} if isinstance(s, str) else s for name, s in v.items()}

    @model_validator(mode="after")
    def _scorer_threshold(self) -> "ServeConfig":
        """The server's rule, where it sets no threshold, takes the scorer's (none for a shipped scorer)."""
        self.rule = self.rule.with_default_threshold(declared_threshold(self.scorer))
        return self

    @model_validator(mode="after")
    def _autoscaling(self) -> "ServeConfig":
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both min_replicas and max_replicas")
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:  # type: ignore[operator]
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self

    @model_validator(mode="after")
    def _judges(self) -> "ServeConfig":
        for name in self.judges or ():
            try:
                entry = update_judge(name)
            except ValueError as exc:
                raise ValueError(f"judges: {exc}") from None
            if entry.needs_llm and self.rule.supersede.judge != name:
                raise ValueError(f"judges: {name!r} needs an LLM, which only the server's rule configures "
                                 f"(rule.supersede.judge: {name} with its llm_config)")
        return self

    def allowed_judges(self) -> frozenset[str]:
        """The update judges a request may name (`judges`, or the default: no-LLM judges + the server rule's)."""
        if self.judges is not None:
            return frozenset(self.judges)
        own = {self.rule.supersede.judge} if self.rule.supersede.judge else set()
        return frozenset({n for n, e in UPDATE_JUDGES.items() if not e.needs_llm} | own)

    def deployment_options(self) -> dict[str, object]:
        """The Ray Serve deployment options: replicas (or autoscaling bounds), resources, concurrency."""
        scale: dict[str, object] = ({"num_replicas": self.replicas} if self.max_replicas is None else
                                    {"autoscaling_config": {"min_replicas": self.min_replicas,
                                                            "max_replicas": self.max_replicas}})
        return {**scale, "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                "max_ongoing_requests": self.max_ongoing_requests}
