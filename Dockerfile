# One image for every component: operator, node agent, OCI hook, CLI and libibckpt.so.
FROM debian:bookworm-slim AS native
RUN apt-get update && apt-get install -y --no-install-recommends gcc make libc6-dev libibverbs-dev \
    && rm -rf /var/lib/apt/lists/*
COPY native/ /src/native/
RUN make -C /src/native build/libibckpt.so

FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends criu iptables libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/ibckpt
COPY pyproject.toml README.md ./
COPY ibckpt/ ibckpt/
COPY operator/ operator/
COPY runtime-hook/ runtime-hook/
COPY native/ibckpt_native/ native/ibckpt_native/
RUN pip install --no-cache-dir .
COPY --from=native /src/native/build/libibckpt.so /usr/lib/ibckpt/libibckpt.so
USER 65532
ENTRYPOINT ["ibckpt"]
