# FlexLB router / worker image. One image, two roles: the argv after `flexlb` picks one.
#   docker build -t flexlb .
#   docker run --rm -p 8000:8000 -e FLEXLB_HOST=0.0.0.0 -e FLEXLB_NATS_URL=... -e FLEXLB_REDIS_URL=... flexlb
#   docker run --rm -e FLEXLB_NATS_URL=... flexlb worker --id w0 --role pd_fusion
# Configuration is FLEXLB_* environment variables and `flexlb` flags (see services/settings.py).
# NATS and Redis are not in this image (no `embedded` extra): docker-compose.yml runs the
# official images next to it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src

# 1. Runtime dependencies, read from pyproject.toml: this layer is rebuilt only when
#    pyproject.toml changes, not on every source edit.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 2. The package itself: every directory [tool.setuptools.packages.find] includes
#    (schemas, services, workers; the timing profiles are package data of workers).
COPY schemas ./schemas
COPY services ./services
COPY workers ./workers
#    FLEXLB_EXTRAS adds extras: `--build-arg FLEXLB_EXTRAS=torch` gives the torch engine
#    (`flexlb worker --engine torch`; pip fetches torch for the build platform).
ARG FLEXLB_EXTRAS=""
RUN pip install --no-cache-dir ".${FLEXLB_EXTRAS:+[$FLEXLB_EXTRAS]}" \
    && rm -rf build ./*.egg-info

# 3. Run as an unprivileged user, outside the source tree (the installed package is used).
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin flexlb
USER flexlb
WORKDIR /home/flexlb

# The router's HTTP port (RouterSettings.port). It listens on 127.0.0.1 unless told
# otherwise: set FLEXLB_HOST=0.0.0.0 (or --host 0.0.0.0) to reach it from outside.
EXPOSE 8000

ENTRYPOINT ["flexlb"]
CMD ["router"]
