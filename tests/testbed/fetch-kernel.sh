#!/usr/bin/env bash
# Extracts the Debian kernel that linux-image-amd64 currently points at into
# $IBCKPT_CACHE/kernel (vmlinuz + modules). Nothing goes into the host's /boot.
set -euo pipefail

cache=${IBCKPT_CACHE:-$HOME/.cache/ibckpt}
out=$cache/kernel
if [[ -f $out/kver && -f $out/vmlinuz ]]; then
  echo "fetch-kernel: cached $(cat "$out/kver")"
  exit 0
fi

# Resolve the ABI-named package at install time: fixed names vanish from mirrors.
pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [[ -z $pkg ]]; then
  apt-get update -qq
  pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
[[ -n $pkg ]] || { echo "fetch-kernel: cannot resolve linux-image-amd64" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/ibckpt-kernel.XXXXXX")
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq "$pkg" 2>/dev/null && dpkg-deb -x ./*.deb root)
kver=$(ls "$work/root/lib/modules")
rm -rf "$out.tmp" && mkdir -p "$out.tmp/lib/modules"
cp "$work/root/boot/vmlinuz-$kver" "$out.tmp/vmlinuz"
mv "$work/root/lib/modules/$kver" "$out.tmp/lib/modules/$kver"
depmod -b "$out.tmp" "$kver"
echo "$kver" >"$out.tmp/kver"
rm -rf "$out" && mv "$out.tmp" "$out"
echo "fetch-kernel: $kver into $out"
