#!/usr/bin/env bash
# Installs the Debian packages the testbed needs (qemu, rdma-core, CRIU, Go for
# the apiserver build, ...). Idempotent: a second run installs nothing.
set -euo pipefail

packages=(
  # guest runner
  qemu-system-x86 busybox-static cpio kmod socat iproute2 iputils-ping
  # RDMA userspace (host-built programs run unchanged in the guest)
  rdma-core ibverbs-utils ibverbs-providers rdmacm-utils perftest
  python3-pyverbs libibverbs-dev librdmacm-dev
  # MPI over verbs (docs/mpi.md): Open MPI 4.1 with UCX, and UCX's own perftest
  openmpi-bin libopenmpi-dev ucx-utils
  # process checkpointing
  criu iptables
  # kube-apiserver build from Debian's source package
  dpkg-dev rsync golang-1.19-go golang-github-modern-go-reflect2-dev
  # native shim tooling
  make gcc pkg-config valgrind openssl curl ca-certificates
  # libFuzzer (the control and record parser fuzzers)
  clang-14 libclang-rt-14-dev
  # helm comes out of an npm package's zip
  unzip
  # Kubernetes nodes in the guests: runtime, CNI, and images built without a registry
  containerd runc crun containernetworking-plugins conntrack ethtool
  debootstrap umoci skopeo buildah podman fuse-overlayfs uidmap
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-system: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install-system: ok"
