# devplug container image: a first working version (the Operations work hardens it further).
# Stage 1 builds wheels for devplug and its dependencies; stage 2 installs only those wheels
# plus libudev on a slim base.
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
# The kubelet's device plugin dir is root-owned; the DaemonSet drops every capability.
USER 0:0
ENTRYPOINT ["devplug"]
CMD ["run"]
