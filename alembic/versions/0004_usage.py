"""Usage per namespace kept by triggers in the transaction of every change; parts record their namespace.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE_TRIGGERS = [
    """CREATE TRIGGER usage_blocks_insert AFTER INSERT ON blocks BEGIN
      INSERT INTO usage (namespace, slot, blocks, bytes) VALUES (NEW.namespace, 0, 1, NEW.size)
      ON CONFLICT (namespace, slot) DO UPDATE SET blocks = blocks + 1, bytes = bytes + excluded.bytes;
    END""",
    """CREATE TRIGGER usage_blocks_delete AFTER DELETE ON blocks BEGIN
      UPDATE usage SET blocks = blocks - 1, bytes = bytes - OLD.size WHERE namespace = OLD.namespace AND slot = 0;
    END""",
    """CREATE TRIGGER usage_blocks_update AFTER UPDATE OF size ON blocks BEGIN
      UPDATE usage SET bytes = bytes + NEW.size - OLD.size WHERE namespace = NEW.namespace AND slot = 0;
    END""",
    """CREATE TRIGGER usage_parts_insert AFTER INSERT ON parts BEGIN
      INSERT INTO usage (namespace, slot, blocks, bytes)
      VALUES (COALESCE(NEW.namespace, ''), 0, 0, NEW."end" - NEW.start)
      ON CONFLICT (namespace, slot) DO UPDATE SET bytes = bytes + excluded.bytes;
    END""",
    """CREATE TRIGGER usage_parts_delete AFTER DELETE ON parts BEGIN
      UPDATE usage SET bytes = bytes - (OLD."end" - OLD.start)
      WHERE namespace = COALESCE(OLD.namespace, '') AND slot = 0;
    END""",
]
"""(also what a later batch migration of blocks or parts must run again: a table rebuild drops its triggers)"""

# PostgreSQL: each transaction adds its deltas to one of 16 slots (by backend), so that concurrent transactions of
# several replicas seldom wait on one another's row lock; readers sum the slots.
POSTGRES_FUNCTIONS = [
    """CREATE FUNCTION kvgate_usage_add(ns text, nblocks bigint, nbytes bigint) RETURNS void LANGUAGE sql AS $$
      INSERT INTO usage (namespace, slot, blocks, bytes) VALUES (ns, pg_backend_pid() % 16, nblocks, nbytes)
      ON CONFLICT (namespace, slot) DO UPDATE SET blocks = usage.blocks + EXCLUDED.blocks,
                                                  bytes = usage.bytes + EXCLUDED.bytes
    $$""",
    """CREATE FUNCTION kvgate_usage_blocks() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF TG_OP = 'INSERT' THEN
        PERFORM kvgate_usage_add(NEW.namespace, 1, NEW.size);
      ELSIF TG_OP = 'DELETE' THEN
        PERFORM kvgate_usage_add(OLD.namespace, -1, -OLD.size);
      ELSIF NEW.size <> OLD.size THEN
        PERFORM kvgate_usage_add(NEW.namespace, 0, NEW.size - OLD.size);
      END IF;
      RETURN NULL;
    END $$""",
    """CREATE FUNCTION kvgate_usage_parts() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF TG_OP = 'INSERT' THEN
        PERFORM kvgate_usage_add(COALESCE(NEW.namespace, ''), 0, NEW."end" - NEW.start);
      ELSE
        PERFORM kvgate_usage_add(COALESCE(OLD.namespace, ''), 0, -(OLD."end" - OLD.start));
      END IF;
      RETURN NULL;
    END $$""",
    """CREATE TRIGGER usage_blocks AFTER INSERT OR DELETE OR UPDATE OF size ON blocks
       FOR EACH ROW EXECUTE FUNCTION kvgate_usage_blocks()""",
    """CREATE TRIGGER usage_parts AFTER INSERT OR DELETE ON parts FOR EACH ROW EXECUTE FUNCTION kvgate_usage_parts()""",
]


def _namespace_of(key: str) -> str:
    """``<ns>_r<rank>/...`` -> ``<ns>`` (the block key grammar of contract/keys.py)."""
    head = key.split("/", 1)[0]
    ns, sep, rank = head.rpartition("_r")
    return ns if sep and rank.isascii() and rank.isdigit() else head


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("namespace", sa.String(256), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("blocks", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("namespace", "slot", name=op.f("pk_usage")),
    )
    op.add_column("parts", sa.Column("namespace", sa.String(256), nullable=True))  # plain ADD COLUMN: no rebuild
    conn = op.get_bind()
    for (key,) in conn.execute(sa.text("SELECT DISTINCT key FROM parts")).all():
        conn.execute(sa.text("UPDATE parts SET namespace = :ns WHERE key = :k"), {"ns": _namespace_of(key), "k": key})
    conn.execute(
        sa.text(
            "INSERT INTO usage (namespace, slot, blocks, bytes) "
            "SELECT namespace, 0, SUM(blocks), SUM(bytes) FROM ("
            "  SELECT namespace, COUNT(*) AS blocks, SUM(size) AS bytes FROM blocks GROUP BY namespace"
            "  UNION ALL"
            "  SELECT COALESCE(namespace, ''), 0, SUM(\"end\" - start) FROM parts GROUP BY namespace"
            ") AS u GROUP BY namespace"
        )
    )
    for statement in POSTGRES_FUNCTIONS if conn.dialect.name == "postgresql" else SQLITE_TRIGGERS:
        conn.execute(sa.text(statement))


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("DROP TRIGGER IF EXISTS usage_parts ON parts"))
        conn.execute(sa.text("DROP TRIGGER IF EXISTS usage_blocks ON blocks"))
        for fn in ("kvgate_usage_parts()", "kvgate_usage_blocks()", "kvgate_usage_add(text, bigint, bigint)"):
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {fn}"))
    else:
        for name in ("usage_blocks_insert", "usage_blocks_delete", "usage_blocks_update"):
            conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}"))
        for name in ("usage_parts_insert", "usage_parts_delete"):
            conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}"))
    with op.batch_alter_table("parts") as batch:
        batch.drop_column("namespace")
    op.drop_table("usage")
