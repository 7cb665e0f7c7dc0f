from tests.services import moto_server  # noqa: F401
