# One image for every kvgate role: `kvgate gate`, `agent`, `sim`, `envoy-config`, ... (the chart picks
# the subcommand in args). It installs kvgate and its pinned runtime dependencies from wheels built
# outside the container, so the build needs no network and gets the versions the tests ran:
#
#   make image                       # or: python scripts/build_image.py --image kvgate:dev
#
# By hand: put the wheels in ./wheels (`pip wheel --wheel-dir wheels .`), then `docker build .`.
# Works with the legacy builder and BuildKit alike (no RUN --mount, no heredocs).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS install
COPY wheels/ /tmp/wheels/
# python3 is /usr/local/bin/python3 in the python images and /usr/bin/python3 in Debian's; the venv
# links to whichever the base has, and the runtime stage has the same base.
# pip compiles every module to bytecode at install: the root filesystem is read-only at run time, so
# bytecode missing here would be compiled again at every start.
RUN python3 -m venv /opt/kvgate \
 && /opt/kvgate/bin/python -m pip install --no-cache-dir --no-index --find-links /tmp/wheels \
      --disable-pip-version-check kvgate \
 && /opt/kvgate/bin/python -m pip uninstall --yes --disable-pip-version-check pip setuptools \
 && /opt/kvgate/bin/kvgate --help > /dev/null

FROM ${BASE_IMAGE}
ARG VERSION=0.0.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="Admission gate for LLM inference traffic: an Envoy ext_proc server that routes by estimated KV-cache tokens, its per-GPU-node headroom agent and a simulated GPU node" \
      org.opencontainers.image.source="https://github.com/kvgate/kvgate" \
      org.opencontainers.image.url="https://github.com/kvgate/kvgate" \
      org.opencontainers.image.documentation="https://github.com/kvgate/kvgate/blob/main/docs/helm.md" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --from=install /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The chart's runAsUser; numeric, so Kubernetes' runAsNonRoot can check it without /etc/passwd.
USER 65532:65532
# gate ext_proc, gate metrics (worker i on 9464 + i), agent gRPC, agent metrics, sim HTTP.
EXPOSE 9002 9464 9100 9465 8000
# No HEALTHCHECK: Kubernetes probes the gate and the agent over gRPC health and the sim over HTTP.
ENTRYPOINT ["kvgate"]
CMD ["--help"]
