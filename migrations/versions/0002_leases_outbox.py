"""candidate leases (claim token, expiry), the dispatch outbox marker, sweep indexes

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("candidates", schema=None) as batch_op:
        batch_op.add_column(sa.Column("claim_token", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("lease_expires_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("dispatched_at", sa.DateTime(), nullable=True))
        batch_op.create_index("ix_candidates_status_lease", ["status", "lease_expires_at"])
        batch_op.create_index("ix_candidates_status_queued", ["status", "queued_at"])
    with op.batch_alter_table("goals", schema=None) as batch_op:
        batch_op.create_index("ix_goals_status_updated", ["status", "updated_at"])


def downgrade() -> None:
    with op.batch_alter_table("goals", schema=None) as batch_op:
        batch_op.drop_index("ix_goals_status_updated")
    with op.batch_alter_table("candidates", schema=None) as batch_op:
        batch_op.drop_index("ix_candidates_status_queued")
        batch_op.drop_index("ix_candidates_status_lease")
        batch_op.drop_column("dispatched_at")
        batch_op.drop_column("lease_expires_at")
        batch_op.drop_column("claim_token")
