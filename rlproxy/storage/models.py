"""The SQL schema: ORM models for `runs`, `completions` and `training_steps`.

Table and column names are part of the public contract (users query them with plain SQL); add
columns freely, never rename. JSON columns hold JSON text in SQLite (use `json_extract`) and
JSON in PostgreSQL. Times are UTC. Every change here needs an Alembic migration.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from rlproxy.storage.step_columns import STEP_COLUMNS


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(UTC)


def _noted(type_: Any, comment: str) -> Any:
    """`mapped_column(type_, comment=comment)`: a column and what it holds (nullable by its annotation)."""
    return mapped_column(type_, comment=comment)


class Base(DeclarativeBase):
    """Declarative base of every rlproxy table."""

    # none_as_null: a missing value is SQL NULL (`WHERE error IS NULL` style queries work), not 'null'.
    type_annotation_map = {dict[str, Any]: JSON(none_as_null=True), list[Any]: JSON(none_as_null=True)}


class RunStatus(enum.StrEnum):
    """Life of a run (an episode keyed by X-Run-Id)."""

    open = "open"  # completions arriving, no reward yet
    completed = "completed"  # rewarded; waiting for its group to be trained
    trained = "trained"  # used by training step `trained_step`
    skipped = "skipped"  # its group had zero reward variance: no gradient, never trained
    failed = "failed"  # unusable for training (e.g. no completion with tokens)
    expired = "expired"  # never rewarded within the expiry time
    ungrouped = "ungrouped"  # rewarded, but alone in its group past group_timeout (status_reason says why)
    validated = "validated"  # a validation run (split val), rewarded: measured, never trained


class Run(Base):
    """One episode: the completions sharing an X-Run-Id, and the reward posted for it."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True, comment="X-Run-Id of the episode")
    group_id: Mapped[str | None] = mapped_column(
        String(128),
        index=True,
        comment="X-Group-Id, or a hash of policy+tools+prompt of its first completion",
    )
    policy: Mapped[str | None] = _noted(String(256), "policy of its first completion")
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.open, index=True)
    reward: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(comment="named numbers posted with the reward")
    metadata_: Mapped[dict[str, Any] | None] = mapped_column(
        "metadata", comment="free JSON posted with the reward"
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    completed_at: Mapped[datetime | None] = _noted(DateTime(timezone=True), "when rewarded")
    trained_step: Mapped[int | None] = _noted(Integer, "training_steps.step that used it")
    status_reason: Mapped[str | None] = _noted(
        String(32),
        "why the trainer set its status: no_sibling, zero_variance, stale, no_usable_completion, "
        "nonfinite (see storage/training.py)",
    )
    # judge rewards (migration 0006; trainer/judge.py)
    reward_source: Mapped[str | None] = _noted(
        String(16), "app or judge (NULL reward: waiting for the judge)"
    )
    judge_explanation: Mapped[str | None] = _noted(Text, "the judge's short reason for its score")
    judge_rubric: Mapped[str | None] = _noted(
        Text, "rubric named when the run was completed (NULL: the policy's)"
    )
    # validation runs (migration 0008; storage/validation.py)
    split: Mapped[str] = mapped_column(
        String(8),
        default="train",
        server_default="train",
        comment="train, or val: a validation run, served and stored but never trained",
    )
    # several writers (migration 0009; storage/rows.py)
    next_seq: Mapped[int] = mapped_column(
        Integer,
        default=0,
        server_default="0",
        comment="seq the run's next completion gets (the writers' counter, see storage/rows.py)",
    )
    # merged segments (migration 0010; trainer/segments.py): what the trainer made of the run's calls
    segments: Mapped[int | None] = _noted(
        Integer, "rows the trainer merged the run's calls into (1: every call extended the last)"
    )
    segment_breaks: Mapped[str | None] = _noted(
        Text, 'why the run split: JSON list of {"seq", "reason", "at", "of"} (NULL: no break)'
    )

    # siblings (migration 0015; storage/siblings.py): a run the proxy made by sampling a stored prompt
    branch_of: Mapped[int | None] = _noted(
        Integer, "completions.id this sibling run answers again (NULL: an app's run)"
    )
    # keys per app (migration 0016; proxy/keys.py)
    key_id: Mapped[str | None] = mapped_column(
        String(32), index=True, comment="keys.id of the app that made it (NULL: the shared agents' key)"
    )

    __table_args__ = (
        Index("ix_runs_status_group", "status", "group_id"),
        Index("ix_runs_created_at", "created_at", "id"),  # newest-first listing with a stable cursor
        # the trainer's poll: oldest-first runs of one status, never a scan of all runs
        Index("ix_runs_status_completed", "status", "completed_at", "id"),
    )


class Completion(Base):
    """One model call of a run as the upstream answered it, with the exact sampled tokens."""

    __tablename__ = "completions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = _noted(
        ForeignKey("runs.id", ondelete="CASCADE"), "NULL when the request carried no run key"
    )
    seq: Mapped[int | None] = _noted(Integer, "0,1,2,... order of the call within its run")
    policy: Mapped[str | None] = _noted(String(256), "policy the request named")
    adapter: Mapped[str | None] = _noted(String(256), "model the upstream served: base or policy@step")
    policy_step: Mapped[int | None] = _noted(Integer, "0 = base model")
    endpoint: Mapped[str | None] = _noted(String(64), "chat.completions or completions")
    stream: Mapped[bool | None] = mapped_column()
    request: Mapped[dict[str, Any] | None] = mapped_column(comment="the client's request body, as sent")
    response: Mapped[dict[str, Any] | None] = mapped_column(
        comment="the response as the client got it (streams assembled)"
    )
    prompt_token_ids: Mapped[list[Any] | None] = mapped_column()
    token_ids: Mapped[list[Any] | None] = mapped_column(comment="sampled token ids, one list per choice")
    logprobs: Mapped[list[Any] | None] = mapped_column(comment="sampling logprobs, one list per choice")
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str | None] = _noted(String(16), "ok, error, cancelled (client disconnected)")
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = _noted(Float, "time to first token (streams)")
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    capture_id: Mapped[str | None] = _noted(
        String(64), "unique id the proxy gave the record (its crash-journal replay stores it once)"
    )
    response_id: Mapped[str | None] = _noted(
        String(64), "Responses API: id of the response object; NULL if store: false"
    )
    client_request: Mapped[dict[str, Any] | None] = mapped_column(
        comment="Responses API: the request body as the client sent it"
    )
    client_response: Mapped[dict[str, Any] | None] = mapped_column(
        comment="Responses API: the response object the client received"
    )
    source: Mapped[str | None] = _noted(
        String(16),
        "hosted: a text-only upstream answered (token ids NULL: SFT data, never a GRPO sample); "
        "NULL: captured with exact tokens",
    )
    key_id: Mapped[str | None] = _noted(
        String(32), "keys.id of the app that made the call (NULL: the shared agents' key)"
    )

    __table_args__ = (
        UniqueConstraint("run_id", "seq", name="uq_completions_run_seq"),
        Index("ux_completions_capture_id", "capture_id", unique=True),
        Index("ux_completions_response_id", "response_id", unique=True),
    )


class Key(Base):
    """An app's key (`rlproxy keys create`): what it may use, at what rate; its secret stored hashed."""

    __tablename__ = "keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, comment="public id, key_<hex>")
    name: Mapped[str] = mapped_column(String(128), unique=True, comment="the operator's name for the app")
    secret_hash: Mapped[str] = _noted(String(64), "sha256 hex of the secret (rk-...)")
    policies: Mapped[list[Any] | None] = mapped_column(comment="JSON list of policies it may use; NULL: all")
    rpm: Mapped[int | None] = _noted(Integer, "requests per minute (NULL: no limit)")
    tpm: Mapped[int | None] = _noted(Integer, "tokens per minute (NULL: no limit)")
    max_streams: Mapped[int | None] = _noted(Integer, "streams in flight (NULL: no limit)")
    scorer_url: Mapped[str | None] = _noted(Text, "its own scorer for siblings (NULL: none)")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = _noted(DateTime(timezone=True), "NULL: valid")
    last_used_at: Mapped[datetime | None] = _noted(
        DateTime(timezone=True), "last request seen (updated once a minute at most per replica)"
    )


def _step_metrics(integer: bool) -> dict[str, Any]:
    """training_steps' metric columns, declared from THE list (storage/step_columns.py): the FLOAT
    headline numbers of `metrics` (migration 0005) or the INTEGER counts of merged segments (0010)."""
    return {
        name: _noted(Integer if c.integer else Float, c.comment)
        for name, c in STEP_COLUMNS.items()
        if c.integer == integer
    }


class TrainingStep(Base):
    """One GRPO optimizer step of a policy and the adapter it produced."""

    __tablename__ = "training_steps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    step: Mapped[int] = _noted(Integer, "1,2,... per policy; adapter served as policy@step")
    policy: Mapped[str] = mapped_column(String(256))
    adapter_path: Mapped[str | None] = _noted(Text, "checkpoint folder holding the adapter")
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    num_groups: Mapped[int | None] = mapped_column(Integer)
    num_runs: Mapped[int | None] = mapped_column(Integer)
    num_tokens: Mapped[int | None] = _noted(Integer, "sampled tokens trained on")
    mean_reward: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(
        comment="loss/, kl/, clip/, reward/, perf/ numbers"
    )
    config: Mapped[dict[str, Any] | None] = mapped_column(comment="resolved trainer settings of this step")
    locals().update(_step_metrics(integer=False))  # in the class body: the columns keep their order
    kind: Mapped[str] = mapped_column(
        String(16), default="grpo", server_default="grpo", comment="grpo, or sft for supervised steps"
    )  # also fork / init: step 1 of a policy started from another's step or a LoRA folder (PolicyOrigin)
    # validation (migration 0008; storage/validation.py)
    val_reward: Mapped[float | None] = _noted(
        Float, "mean reward of the val runs served by step - 1 (at the commit)"
    )
    val_runs: Mapped[int | None] = _noted(Integer, "how many val runs val_reward averages")
    locals().update(_step_metrics(integer=True))  # merged segments (trainer/segments.py)

    __table_args__ = (UniqueConstraint("policy", "step", name="uq_training_steps_policy_step"),)


class PolicyOrigin(Base):
    """How a policy started (migration 0007): forked from `parent@parent_step`, or from the LoRA folder
    `init_adapter`. Its step 1 (`training_steps.kind` fork / init) is that adapter; a policy that
    started from a fresh adapter has no row."""

    __tablename__ = "policies"

    name: Mapped[str] = mapped_column(String(256), primary_key=True, comment="the policy")
    parent: Mapped[str | None] = _noted(String(256), "policy it was forked from")
    parent_step: Mapped[int | None] = _noted(Integer, "step of parent it was forked from")
    init_adapter: Mapped[str | None] = _noted(Text, "LoRA folder it started from (--init-adapter)")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RolloutStatus(enum.StrEnum):
    """Life of a canary rollout (migration 0013; storage/rollouts.py)."""

    canary = "canary"  # the candidate serves canary_fraction of new runs; the rule looks at the arms
    promoted = "promoted"  # the candidate serves every run (the policy's step from now on)
    rolled_back = "rolled_back"  # the candidate serves nothing, ever again; the incumbent stays


class Rollout(Base):
    """One canary of a policy: a candidate step against the incumbent it would replace (issue 28)."""

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy: Mapped[str] = _noted(String(256), "the policy")
    candidate_step: Mapped[int] = _noted(Integer, "the new step on trial")
    incumbent_step: Mapped[int] = _noted(Integer, "the step it would replace (0 = base)")
    fraction: Mapped[float] = _noted(Float, "share of new runs the candidate serves, 0-1")
    status: Mapped[str] = mapped_column(
        String(16), default=RolloutStatus.canary, comment="canary, promoted or rolled_back"
    )
    decision: Mapped[str | None] = _noted(
        String(16), "the last look's outcome: continue, promote or rollback"
    )
    decided_by: Mapped[str | None] = _noted(String(16), "rule, or manual (rlproxy rollout)")
    reason: Mapped[str | None] = _noted(Text, "why, in words (the test and its numbers)")
    looks: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0", comment="looks the rule took (each spends alpha / looks)"
    )
    statistic: Mapped[str | None] = _noted(String(16), "welch_t, paired_t or errors_z")
    stat_value: Mapped[float | None] = _noted(Float, "the statistic at the last look")
    p_value: Mapped[float | None] = _noted(Float, "its one-sided p-value")
    candidate_runs: Mapped[int | None] = _noted(Integer, "rewarded runs of the candidate arm")
    incumbent_runs: Mapped[int | None] = _noted(Integer, "rewarded runs of the incumbent arm")
    candidate_reward: Mapped[float | None] = _noted(Float, "mean reward, candidate arm")
    incumbent_reward: Mapped[float | None] = _noted(Float, "mean reward, incumbent arm")
    candidate_error_rate: Mapped[float | None] = _noted(
        Float, "share of the candidate's runs with a 5xx or a completion cut at its length"
    )
    incumbent_error_rate: Mapped[float | None] = _noted(Float, "the same, incumbent arm")
    started_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, comment="runs created from then on are assigned"
    )
    looked_at: Mapped[datetime | None] = _noted(DateTime(timezone=True), "the last look")
    decided_at: Mapped[datetime | None] = _noted(DateTime(timezone=True), "promoted or rolled back at")

    __table_args__ = (
        # one rollout per candidate step: two trainers or proxies can never open (or decide) it twice
        UniqueConstraint("policy", "candidate_step", name="uq_rollouts_policy_candidate"),
        Index("ix_rollouts_policy_status", "policy", "status"),
    )


class SiblingStatus(enum.StrEnum):
    """Life of a sibling group (migration 0015; storage/siblings.py). Training status is its runs'."""

    sampling = "sampling"  # chosen; the engine has not answered all of its K-1 (or K) requests yet
    scoring = "scoring"  # every member stored (runs `open`, reward NULL); waiting for its scorer
    scored = "scored"  # every member has its score (runs `completed`, reward_source 'sibling')
    failed = "failed"  # sampling or scoring failed for good (`error` says why); never trained


class SiblingGroup(Base):
    """K answers to one stored prompt from one policy step: the app's call and the proxy's siblings.

    Its members are the runs whose `group_id` is this `id` (one completion each, `runs.branch_of` =
    `completion_id`); their `reward` is the scorer's score, `reward_source` 'sibling'.
    """

    __tablename__ = "sibling_groups"

    id: Mapped[str] = mapped_column(String(128), primary_key=True, comment="the members' runs.group_id")
    completion_id: Mapped[int] = _noted(
        ForeignKey("completions.id", ondelete="CASCADE"), "the app's call it branched from"
    )
    run_id: Mapped[str | None] = _noted(String(128), "that call's run (NULL: untagged)")
    policy: Mapped[str] = _noted(String(256), "policy that sampled every member")
    policy_step: Mapped[int | None] = _noted(Integer, "step that sampled them (0 = base)")
    k: Mapped[int] = _noted(Integer, "members, the app's answer included when with_original")
    with_original: Mapped[bool] = mapped_column(
        default=True, comment="the app's answer is a member (false: its step was gone, K fresh answers)"
    )
    reason: Mapped[str] = _noted(String(16), "new, alone or plateau (settings.siblings)")
    temperature: Mapped[float | None] = _noted(Float, "sampling temperature of the siblings")
    status: Mapped[str] = mapped_column(
        String(16), default=SiblingStatus.sampling, comment="sampling, scoring, scored or failed"
    )
    scorer: Mapped[str | None] = _noted(String(32), "checks, url or judge (+checks)")
    attempts: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0", comment="scorer calls made so far"
    )
    error: Mapped[str | None] = _noted(Text, "why it failed (the last scorer error)")
    sampled_tokens: Mapped[int | None] = _noted(Integer, "tokens the siblings sampled")
    sample_ms: Mapped[float | None] = _noted(Float, "engine wall time of the siblings, ms")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    scored_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("completion_id", name="uq_sibling_groups_completion"),  # a call branches once
        Index("ix_sibling_groups_status", "status", "created_at"),
    )


class ShadowCheck(Base):
    """A new step and the serving step on the same stored prompts, scored, before the step serves anyone."""

    __tablename__ = "shadow_checks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy: Mapped[str] = mapped_column(String(256))
    candidate_step: Mapped[int] = _noted(Integer, "the new step")
    serving_step: Mapped[int] = _noted(Integer, "the step serving when it ran (0 = base)")
    status: Mapped[str] = _noted(String(16), "running, passed, failed (rolled back) or error")
    prompts: Mapped[int | None] = _noted(Integer, "prompt pairs scored")
    candidate_score: Mapped[float | None] = _noted(Float, "mean score of the candidate")
    serving_score: Mapped[float | None] = _noted(Float, "mean score of the serving step")
    margin: Mapped[float | None] = _noted(Float, "shadow_margin in force")
    scorer: Mapped[str | None] = mapped_column(String(32))
    pairs: Mapped[list[Any] | None] = mapped_column(
        comment='JSON list of {"completion_id", "candidate", "serving"} scores'
    )
    reason: Mapped[str | None] = _noted(Text, "the decision in words")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (UniqueConstraint("policy", "candidate_step", name="uq_shadow_checks_candidate"),)
