"""goals, iterations, candidates

Revision ID: 0001
Revises:
Create Date: 2026-11-30 03:25:13.557232
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "goals",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("stop_reason", sa.String(length=32), nullable=True),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("generations_reserved", sa.Integer(), nullable=False),
        sa.Column("best_candidate_id", sa.String(length=32), nullable=True),
        sa.Column("best_score", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_goals")),
    )
    with op.batch_alter_table("goals", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_goals_status"), ["status"], unique=False)

    op.create_table(
        "iterations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("goal_id", sa.String(length=32), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("best_score", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["goal_id"], ["goals.id"], name=op.f("fk_iterations_goal_id_goals"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_iterations")),
        sa.UniqueConstraint("goal_id", "index", name="uq_iterations_goal_index"),
    )
    with op.batch_alter_table("iterations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_iterations_goal_id"), ["goal_id"], unique=False)

    op.create_table(
        "candidates",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("goal_id", sa.String(length=32), nullable=False),
        sa.Column("iteration_id", sa.Integer(), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("negative_prompt", sa.Text(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=128), nullable=True),
        sa.Column("clip_score", sa.Float(), nullable=True),
        sa.Column("part_scores", sa.JSON(), nullable=False),
        sa.Column("artifact_uri", sa.Text(), nullable=True),
        sa.Column("timings", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("parent_id", sa.String(length=32), nullable=True),
        sa.Column("edit", sa.Text(), nullable=True),
        sa.Column("queued_at", sa.DateTime(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["goal_id"], ["goals.id"], name=op.f("fk_candidates_goal_id_goals"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["iteration_id"],
            ["iterations.id"],
            name=op.f("fk_candidates_iteration_id_iterations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_candidates")),
        sa.UniqueConstraint(
            "goal_id", "iteration", "ordinal", name="uq_candidates_goal_iter_ordinal"
        ),
    )
    with op.batch_alter_table("candidates", schema=None) as batch_op:
        batch_op.create_index("ix_candidates_goal_status", ["goal_id", "status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("candidates", schema=None) as batch_op:
        batch_op.drop_index("ix_candidates_goal_status")

    op.drop_table("candidates")
    with op.batch_alter_table("iterations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_iterations_goal_id"))

    op.drop_table("iterations")
    with op.batch_alter_table("goals", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_goals_status"))

    op.drop_table("goals")
