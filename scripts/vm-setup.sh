#!/usr/bin/env bash
# The VM lab's set-up (docs/testing.md): the Debian packages that boot a guest and the tools the
# guest runs from the host's own userspace, virtme-ng from PyPI in a venv of the lab's own, and
# two Debian kernels unpacked into the lab's directory:
#   odp    Debian trixie-backports' newest kernel (7.x): Soft-RoCE with on-demand paging, so
#          page-cache namespaces can be served over rdma;
#   stock  Debian 12's own kernel (6.1): Soft-RoCE without ODP (what most hosts run today).
# The machine's apt sources are not changed: the backports kernel is fetched with a private
# sources list, lists and cache under the lab's directory. Idempotent: what is there is kept.
#
# Usage: scripts/vm-setup.sh            (RPMA_VMLAB_DIR: where, default build/vmlab)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LAB="${RPMA_VMLAB_DIR:-$ROOT/build/vmlab}"
VIRTME_NG_VERSION="1.42"
BACKPORTS="trixie-backports"

say() { echo "vm-setup: $*" >&2; }

PACKAGES=(
  # boot: qemu (TCG or KVM), virtme-ng's initramfs (busybox-static) and module tools (kmod)
  qemu-system-x86 busybox-static kmod python3-venv
  # run in the guest from the host's userspace: Soft-RoCE and perftest, emulated pmem, kernel
  # block-device clients, NVMe/TCP host tools, file systems
  rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest iproute2
  ndctl daxctl nbd-client mdadm nvme-cli e2fsprogs util-linux fio tshark strace
)

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

install_virtme_ng() {
  local venv="$LAB/venv"
  if [ -x "$venv/bin/vng" ] && "$venv/bin/vng" --version 2>/dev/null | grep -q "$VIRTME_NG_VERSION"; then
    return 0
  fi
  say "installing virtme-ng $VIRTME_NG_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "virtme-ng==$VIRTME_NG_VERSION"
}

# apt-get/apt-cache with a private sources list (SUITE of deb.debian.org), lists and cache
# under $LAB/apt/SUITE.
private_apt() {
  local suite="$1" tool="$2"
  shift 2
  local d="$LAB/apt/$suite"
  "$tool" -o Dir::Etc::sourcelist="$d/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
    -o Dir::State::Lists="$d/lists" -o Dir::Cache="$d/cache" -o Debug::NoLocking=1 \
    -o APT::Sandbox::User=root "$@"
}

private_update() {
  local suite="$1" d="$LAB/apt/$1"
  mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
  echo "deb http://deb.debian.org/debian $suite main" >"$d/sources.list"
  private_apt "$suite" apt-get update -qq
}

# The kernel package the candidate linux-image-amd64 meta-package of an apt view depends on.
kernel_of_meta() {
  "$@" depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\)$/\1/p' | head -1
}

# Unpacks .debs into $LAB/kernels/NAME and points $LAB/kernels/NAME/vmlinuz at the image; the
# modules stay beside it (usr/lib/modules/VER), where virtme-ng finds them.
unpack_kernel() {
  local name="$1" dir="$2"
  shift 2
  local dest="$LAB/kernels/$name.tmp"
  rm -rf "$dest"
  mkdir -p "$dest"
  for deb in "$@"; do dpkg-deb -x "$deb" "$dest"; done
  local img
  img="$(find "$dest" -path '*/lib/modules/*/vmlinuz' -o -path '*/boot/vmlinuz-*' | head -1)"
  [ -n "$img" ] || { say "no kernel image in $*"; exit 1; }
  ln -sfn "${img#"$dest"/}" "$dest/vmlinuz"
  rm -rf "$LAB/kernels/$name"
  mv "$dest" "$LAB/kernels/$name"
  rm -rf "$dir"
}

fetch_odp_kernel() {
  [ -e "$LAB/kernels/odp/vmlinuz" ] && return 0
  say "fetching the $BACKPORTS kernel (Soft-RoCE with ODP)"
  private_update "$BACKPORTS"
  local image ver dl
  image="$(kernel_of_meta private_apt "$BACKPORTS" apt-cache)"
  [ -n "$image" ] || { say "no linux-image-amd64 in $BACKPORTS"; exit 1; }
  ver="${image#linux-image-}"
  dl="$LAB/apt/$BACKPORTS/dl"
  mkdir -p "$dl"
  # The signed image package is a shim over linux-binary-VER (vmlinuz) and linux-modules-VER.
  (cd "$dl" && private_apt "$BACKPORTS" apt-get download -qq "linux-binary-$ver" "linux-modules-$ver")
  unpack_kernel odp "$dl" "$dl"/*.deb
  say "odp kernel: $ver"
}

fetch_stock_kernel() {
  [ -e "$LAB/kernels/stock/vmlinuz" ] && return 0
  say "fetching Debian 12's own kernel (Soft-RoCE without ODP)"
  local image
  image="$(kernel_of_meta apt-cache)"
  if [ -z "$image" ]; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    image="$(kernel_of_meta apt-cache)"
  fi
  [ -n "$image" ] || { say "apt knows no linux-image-amd64"; exit 1; }
  local dl="$LAB/apt/stock/dl"
  mkdir -p "$dl"
  (cd "$dl" && apt-get -o APT::Sandbox::User=root download -qq "$image")
  unpack_kernel stock "$dl" "$dl"/*.deb
  say "stock kernel: ${image#linux-image-}"
}

mkdir -p "$LAB"
install_packages
install_virtme_ng
fetch_odp_kernel
fetch_stock_kernel
