"""The one packaging setting pyproject.toml cannot say: the source tree's ``alembic/`` ships as ``app.migrations``.

``alembic/`` stays at the top of the checkout (``alembic upgrade head`` from there uses it through ``alembic.ini``);
in the wheel it becomes ``app/migrations/`` with every file of ``alembic/versions/``, so an installed gateway finds
its migrations through the package. Every package under ``app/``, ``contract/`` and ``connector/`` is found here.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["app", "app.*", "contract", "contract.*", "connector", "connector.*"]),
        "app.migrations",
    ],
    package_dir={"app.migrations": "alembic"},
    package_data={"app.migrations": ["alembic.ini", "script.py.mako", "versions/*.py"]},
)
