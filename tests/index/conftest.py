from tests.services import pg_server, pg_url  # noqa: F401
