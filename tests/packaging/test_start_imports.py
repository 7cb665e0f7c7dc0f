"""What a start loads: ``kvgate serve`` none of the other commands' modules and no alembic once the index is at head,
``kvgate stats`` and the other client commands no server. Each check runs in a new interpreter (this one has
imported everything already); how long a start takes is measured by ``benchmarks/gateway/start_time.py``, not here."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.gateway import REPO


def run_python(code: str) -> str:
    """Run ``code`` in a new interpreter; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_serve_loads_no_other_command_and_no_migrations() -> None:
    run_python(
        """
        import sys
        import app.tools.cli, app.main
        unwanted = ["alembic", "rich", "app.settings_help", "app.tools.bench", "app.tools.bench_clients",
                    "app.tools.importer", "app.tools.admin_cli", "app.tools.events_cli"]
        assert [m for m in unwanted if m in sys.modules] == [], [m for m in unwanted if m in sys.modules]
        """
    )


def test_client_commands_load_no_server() -> None:
    run_python(
        """
        import sys
        import app.tools.cli, app.tools.admin_cli, app.tools.events_cli
        unwanted = ["alembic", "sqlalchemy", "fastapi", "uvicorn", "app.config", "app.main", "app.index"]
        assert [m for m in unwanted if m in sys.modules] == [], [m for m in unwanted if m in sys.modules]
        """
    )


def test_an_index_at_head_is_opened_without_alembic(tmp_path: Path) -> None:
    """A new SQLite file is migrated by alembic; one at head is found so without importing it; one a migration
    behind (downgraded) is brought to head by alembic again."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'index.db'}"

    def migrate() -> str:
        """upgrade_head in a new process: whether it imported alembic."""
        return run_python(
            f"""
            import asyncio, sys
            from app.index.migrate import sqlite_at_head, upgrade_head
            asyncio.run(upgrade_head({url!r}))
            assert sqlite_at_head({url!r})
            print("alembic" in sys.modules, end="")
            """
        )

    assert migrate() == "True"  # a new file
    assert migrate() == "False"  # at head
    run_python(
        f"""
        from alembic import command
        from app.index.migrate import alembic_config, sqlite_at_head
        command.downgrade(alembic_config({url!r}), "0007")
        assert not sqlite_at_head({url!r})
        """
    )
    assert migrate() == "True"  # a migration behind
