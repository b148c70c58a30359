#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler and kubelet
# from Debian's `kubernetes` source package (one Go build) and fetches etcd from Debian's etcd-server package. Results
# are cached in $IBCKPT_CACHE/kube, so a second run costs nothing.
set -euo pipefail

cache=${IBCKPT_CACHE:-$HOME/.cache/ibckpt}
out=$cache/kube
mkdir -p "$out"

bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
have_all() {
  local b
  for b in "${bins[@]}"; do [[ -x $out/$b ]] || return 1; done
}

if have_all && [[ -x $out/etcd && -f $out/pause.c ]]; then
  echo "build-kube: cached in $out"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/ibckpt-kube.XXXXXX")
trap 'rm -rf "$work"' EXIT

# apt-get source needs a deb-src entry. Derive it from the machine's own
# bookworm entry rather than naming any mirror here.
src_list=/etc/apt/sources.list.d/ibckpt-src.sources
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list 2>/dev/null; then
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [[ -n $uri ]] || uri=$(awk '$1=="deb" && $3 ~ /^bookworm/ {print $2; exit}' /etc/apt/sources.list)
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$uri" >"$src_list"
  apt-get update -qq
fi

if [[ ! -x $out/etcd ]]; then
  (cd "$work" && apt-get download -qq etcd-server >/dev/null && dpkg-deb -x etcd-server_*.deb etcd)
  install -m 0755 "$work/etcd/usr/bin/etcd" "$out/etcd"
fi

if ! have_all || [[ ! -f $out/pause.c ]]; then
  (cd "$work" && apt-get source -qq --download-only kubernetes/bookworm >/dev/null &&
    dpkg-source -x --no-check kubernetes_*.dsc src >/dev/null)
  tree=$work/src
  # The vendored reflect2 1.0.1 segfaults under Go >= 1.18: use Debian's 1.0.2.
  vend=$tree/vendor/github.com/modern-go/reflect2
  rm -rf "$vend"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$vend"
  export PATH=/usr/lib/go-1.19/bin:$PATH GOFLAGS=-mod=vendor CGO_ENABLED=0
  export GOCACHE=$work/gocache GOPATH=$work/gopath
  (cd "$tree" && make WHAT="${bins[*]/#/cmd/}" >"$work/make.log" 2>&1) || {
    tail -40 "$work/make.log"
    exit 1
  }
  for b in "${bins[@]}"; do install -m 0755 "$tree/_output/local/bin/linux/amd64/$b" "$out/"; done
  # The pause image is built from the same tree (no registry to pull it from).
  install -m 0644 "$tree/build/pause/linux/pause.c" "$out/pause.c"
fi
echo "build-kube: built into $out"
