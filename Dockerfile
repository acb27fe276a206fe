# devplug container image: the DaemonSet's (deploy/kubernetes/base/daemonset.yaml).
#
# Two stages on one Debian base. "wheels" builds devplug's wheel and fetches its dependencies'
# (and pip's) from PyPI. The final stage installs Debian's python3 and libudev1 with apt, and
# devplug into a virtual environment from those wheels, read through a bind mount: no wheel,
# pip, pip cache, apt list, compiler or file of the build context is left in any layer.
#
#   docker build -t devplug:0.1.0 .
#
# BuildKit (Docker 23 and later by default) or podman/buildah: RUN --mount needs either.
# Adding `--label org.opencontainers.image.revision=$(git rev-parse HEAD)` and
# `--label org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)` records the commit
# and the build time.
#
# Without a registry or PyPI (as devplug's tests build it, tests/test_image.py), a local Debian
# bookworm base and a directory holding wheels/ built on the host (with the same SHA256SUMS
# the wheels stage writes) stand in for the two:
#
#   podman build --build-arg BASE=localhost/debian:bookworm-slim --build-context wheels=DIR .
#
# BASE is pinned by digest (the multi-platform index of debian:bookworm-slim), so a rebuild
# gets the same base until the digest here is changed. To take Debian's latest point release
# and security fixes, read the tag's current digest and put it here:
#
#   docker buildx imagetools inspect docker.io/library/debian:bookworm-slim
#   skopeo inspect --format '{{.Digest}}' docker://docker.io/library/debian:bookworm-slim
#
# Checked with hadolint at warning level in the tests.
ARG BASE=docker.io/library/debian:bookworm-slim@sha256:88200866dfff7ea7f5cbcb6ec7c8a701889efe6fe859fe64d6990e4b07ea4171

FROM ${BASE} AS wheels
# Debian's python3 (3.11) is the one the final stage runs, so the wheels are built for it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv=3.11.* \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN python3 -m venv /build \
    && /build/bin/pip wheel --no-cache-dir --wheel-dir /wheels . pip \
    && sha256sum /wheels/*.whl > /wheels/SHA256SUMS

FROM ${BASE}
ARG BASE
# devplug's version (src/devplug/_version.py; the tests keep the two in step). The install
# below asks for exactly this version, so wheels of another one fail the build.
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="devplug" \
      org.opencontainers.image.description="Kubernetes device plugin daemon: udev discovery, per-resource gRPC servers, CDI specs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE}"
# pyudev loads libudev at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.11.* libudev1=252.* \
    && rm -rf /var/lib/apt/lists/*
# The wheels' hashes: a record in the image of what it installed, and what makes a build cache
# install again when the wheels change (buildah's cache does not key a bind mount's content).
COPY --from=wheels /wheels/SHA256SUMS /opt/devplug/wheels.sha256
# pip runs from its own wheel (a zip Python can run), so the image has no pip. pip compiles the
# bytecode here: the root filesystem is read-only at run time.
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    sha256sum --check --quiet /opt/devplug/wheels.sha256 \
    && python3 -m venv --without-pip /opt/devplug \
    && set -- /wheels/pip-*.whl \
    && /opt/devplug/bin/python "$1/pip" install --no-cache-dir --no-index \
        --find-links /wheels "devplug==${VERSION}"
ENV PATH=/opt/devplug/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# It runs as the image's default user, root: the kubelet's device plugin dir is root-owned
# and hostPath mounts ignore fsGroup. The DaemonSet drops every capability and mounts the root
# filesystem read-only, so root here can write only the two host dirs it is given.
ENTRYPOINT ["devplug"]
CMD ["run"]
