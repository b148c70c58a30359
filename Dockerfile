# One image for every component: operator, node agent, OCI hook, runtime handler, CLI and
# libibckpt.so. Every stage is Debian bookworm, so the shim is built against the same
# rdma-core (libibverbs ABI) that the runtime stage ships, and Python is Debian's 3.11.
FROM debian:bookworm-slim AS native
RUN apt-get update && apt-get install -y --no-install-recommends gcc make libc6-dev libibverbs-dev \
    && rm -rf /var/lib/apt/lists/*
COPY native/ /src/native/
RUN make -C /src/native build/libibckpt.so build/criu/ibckpt_uverbs.so build/ibckpt-front

FROM debian:bookworm-slim AS python
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ibckpt/ ibckpt/
COPY operator/ operator/
COPY runtime-hook/ runtime-hook/
COPY native/ibckpt_native/ native/ibckpt_native/
# Hash-checked bytecode, not mtime-checked: the image's layers round file times to the second, so
# about a quarter of pip's .pyc files came out stale, and the operator (a non-root user on a read-only
# root) recompiled them at every start, minutes on a slow node.
RUN python3 -m venv /opt/ibckpt/venv && /opt/ibckpt/venv/bin/pip install --no-cache-dir --no-compile /src \
    && python3 -m compileall -q -f -j 0 --invalidation-mode unchecked-hash /opt/ibckpt/venv/lib

FROM debian:bookworm-slim
# criu and runc: the agent checkpoints containers through the runtime; iptables: the TCP
# remap of restored connections; libibverbs + providers: the shim's real verbs.
RUN apt-get update && apt-get install -y --no-install-recommends python3 criu runc iptables libibverbs1 \
    ibverbs-providers ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=python /opt/ibckpt/venv /opt/ibckpt/venv
COPY --from=native /src/native/build/libibckpt.so /usr/lib/ibckpt/libibckpt.so
COPY --from=native /src/native/build/criu/ibckpt_uverbs.so /usr/lib/ibckpt/criu/ibckpt_uverbs.so
COPY --from=native /src/native/build/ibckpt-front /usr/lib/ibckpt/ibckpt-front
ENV PATH=/opt/ibckpt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# The operator and CLI run as this user; the agent's pod asks for root (it drives CRIU).
USER 65532
ENTRYPOINT ["ibckpt"]
