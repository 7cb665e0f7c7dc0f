# kvgate gateway image: the app from this checkout on Python 3.11, run as an unprivileged user.
# Build: docker build -t kvgate .      Run: see docker-compose.yml and docs/scale.md.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8750 \
    KVGATE_DATA_DIR=/var/lib/kvgate

WORKDIR /app

# Dependencies first (a layer that survives source edits), then the source. alembic/ and alembic.ini stay
# beside app/: the gateway runs `alembic upgrade head` from them at start-up.
COPY pyproject.toml README.md ./
RUN mkdir -p app connector && touch app/__init__.py connector/__init__.py \
    && pip install . && pip uninstall -y kvgate && rm -rf app connector build *.egg-info
COPY alembic.ini ./
COPY alembic ./alembic
COPY connector ./connector
COPY app ./app

RUN useradd --system --uid 10001 --home-dir /var/lib/kvgate --create-home kvgate
USER kvgate

EXPOSE 8750
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('KVGATE_PORT', '8750')}/readyz\", timeout=2)"]

CMD ["python", "-m", "app", "serve"]
