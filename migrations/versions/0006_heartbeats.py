"""heartbeats: when a periodic job (the sweep) last finished, for /healthz

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-09 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "heartbeats",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("beat_at", sa.DateTime(), nullable=False),
        sa.Column("interval_seconds", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_heartbeats")),
    )


def downgrade() -> None:
    op.drop_table("heartbeats")
