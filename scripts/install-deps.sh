#!/usr/bin/env bash
# Install the Debian packages rpma builds and tests with. Idempotent: only missing packages are
# installed, and `apt-get update` runs only when something is missing.
set -euo pipefail

PACKAGES=(
  # build: rdma-sys runs bindgen against libibverbs/librdmacm headers
  pkg-config libclang-dev clang libibverbs-dev librdmacm-dev
  # lint: scripts/layers.py checks the import structure (3.11 or later: tomllib)
  python3
  # tests: tshark decodes the tcp transport's iWARP traffic; systemd-analyze verifies the unit
  tshark systemd
  # tests: third-party NBD clients against `rpma-initiator nbd` (tests/tests/nbd_clients.rs)
  qemu-utils libnbd-bin fio
  # tests of rpma-initiator mount (FUSE): mkfs.ext4/e2fsck, and losetup/mount/umount. No fuse3:
  # the initiator mounts with mount(2) as root, so fusermount3 is never needed.
  e2fsprogs util-linux
  # tests: real packet loss and a blackout in a network namespace of the link-fault test's own
  # (tests/tests/link_faults.rs: iptables' statistic match on lo; ip comes with iproute2)
  iptables iproute2
  nbdkit  # make bench (bench/matrix.sh): the peer, nbdkit's file plugin, driven by fio's nbd engine
  socat  # bench/nbd-ab.sh --proxy: a plain byte relay in the export's place (two hops, no NBD code)
  # tests/tests/metrics.rs: promtool checks the /metrics exposition, a real Prometheus scrapes it
  prometheus
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
