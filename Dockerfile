# kvgate gateway image: the wheel built from this checkout, installed like any user installs it, run as an
# unprivileged user from its data directory (no source tree in the image).
# Build: docker build -t kvgate .      Run: see docker-compose.yml and docs/operations.md ("Running at scale").
FROM python:3.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md alembic.ini ./
COPY alembic ./alembic
COPY contract ./contract
COPY connector ./connector
COPY app ./app
# kvgate's wheel and every dependency's, so the runtime stage installs offline and carries no build leftovers
RUN pip wheel --wheel-dir /wheels .

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8750 \
    KVGATE_DATA_DIR=/var/lib/kvgate

RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels kvgate

RUN useradd --system --uid 10001 --home-dir /var/lib/kvgate --create-home kvgate
USER kvgate
WORKDIR /var/lib/kvgate

EXPOSE 8750
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('KVGATE_PORT', '8750')}/readyz\", timeout=2)"]

CMD ["kvgate", "serve"]
