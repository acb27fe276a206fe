# devplug container image. Stage 1 builds wheels for devplug and its dependencies; stage 2
# installs only those wheels plus libudev on a slim base: no compiler, no pip cache, no
# build tools. Checked with hadolint at warning level in the tests.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# pyudev loads libudev at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libudev1=252.* \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
# It runs as the image's default user, root: the kubelet's device plugin dir is root-owned
# and hostPath mounts ignore fsGroup. The DaemonSet drops every capability and mounts the root
# filesystem read-only, so root here can write only the two host dirs it is given.
ENTRYPOINT ["devplug"]
CMD ["run"]
