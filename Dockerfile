# cachefs in one image: every daemon, the CLI and the FUSE client.
#
#   docker build -t cachefs:lab .       (docker compose up builds it for you)
#
# Two stages: pyfuse3 has no binary wheels, so it is compiled in the builder
# against libfuse3-dev; the runtime image gets the wheels, fuse3 (fusermount3,
# libfuse3) and fio for the client's workload, but no compiler.

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libfuse3-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cachefs cachefs
COPY metanode metanode
COPY datanode datanode
COPY cachenode cachenode
COPY client client
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[mount]'

FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends fuse3 libfuse3-3 fio \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && mkdir -p /var/lib/cachefs /var/log/cachefs /run/cachefs /mnt/cachefs
# Daemons keep their state under /var/lib/cachefs (a named volume in compose).
VOLUME ["/var/lib/cachefs"]
ENTRYPOINT []
CMD ["cachefs", "--help"]
