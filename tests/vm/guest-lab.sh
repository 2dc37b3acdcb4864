#!/bin/bash
# Inside a VM lab guest (started by scripts/vm-run.sh): sets up the real stack, exports where
# each part is for the tests, then runs the command. Any step that fails stops the run with
# exit 3 and says which: a lab that is half set up must not let a test pass or skip.
#
#   rxe0        Soft-RoCE on dummy0, 10.99.0.1/24 (loopback cannot carry rxe; both ends use
#               this address)            RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR
#   /dev/pmem0  fsdax namespace of region0, ext4 -b 4096 mounted -o dax
#                                        RPMA_TEST_DAX_DIR
#   /dev/dax1.0 devdax namespace of region1
#                                        RPMA_TEST_DEVDAX
#   /dev/ram0   a RAM disk with ext4, the scratch file system (page cache; the checkout is
#               read-only here)          RPMA_TEST_SCRATCH, TMPDIR
#   tmpfs       the scratch of the rdma runs: rxe cannot register file pages (its on-demand
#               paging misplaces data, docs/rdma.md), so their namespace files are pinned
#               memory declared force_dax        RPMA_TEST_RDMA_SCRATCH
#   modules     nbd, loop, fuse, md (raid1), dm, nvme-tcp/nvmet for the kernel-client tests
set -uo pipefail

LABDIR=/tmp/rpma-lab
fail() {
  echo "guest-lab: $*" >&2
  exit 3
}
run() { "$@" >/tmp/rpma-lab-step.log 2>&1 || { cat /tmp/rpma-lab-step.log >&2; fail "failed: $*"; }; }

mkdir -p "$LABDIR"
run ip link set lo up

# Soft-RoCE.
run modprobe rdma_rxe
run ip link add dummy0 type dummy
run ip addr add 10.99.0.1/24 dev dummy0
run ip link set dummy0 up
run rdma link add rxe0 type rxe netdev dummy0
# The port turns active when the kernel has seen dummy0's carrier: a moment on a quiet machine,
# seconds under TCG on a loaded one. Waited for, not timed: the bound (RPMA_VM_RXE_WAIT, 300 s)
# only keeps a broken lab from hanging until vm-run's timeout.
rxe_t0=$(date +%s)
until ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE; do
  if [ $(($(date +%s) - rxe_t0)) -ge "${RPMA_VM_RXE_WAIT:-300}" ]; then
    ibv_devinfo -d rxe0 >&2
    rdma link show >&2
    ip link show dummy0 >&2
    fail "rxe0 did not become PORT_ACTIVE within ${RPMA_VM_RXE_WAIT:-300} s"
  fi
  sleep 0.1
done
rxe_wait=$(($(date +%s) - rxe_t0))
ulimit -l unlimited || fail "cannot raise the memlock limit"

# Emulated persistent memory (the memmap= ranges of vm-run.sh): fsdax with a DAX ext4, devdax.
for m in nd_e820 nd_pmem dax_pmem device_dax; do modprobe "$m" >/dev/null 2>&1; done
run ndctl create-namespace -f -e namespace0.0 -m fsdax
run ndctl create-namespace -f -e namespace1.0 -m devdax
[ -b /dev/pmem0 ] || fail "no /dev/pmem0 after creating the fsdax namespace"
[ -c /dev/dax1.0 ] || fail "no /dev/dax1.0 after creating the devdax namespace"
run mkfs.ext4 -q -F -b 4096 /dev/pmem0
mkdir -p "$LABDIR/pmem"
run mount -o dax /dev/pmem0 "$LABDIR/pmem"
grep -q " $LABDIR/pmem ext4 .*dax" /proc/mounts || fail "$LABDIR/pmem is not mounted with dax"

# Scratch: a page-cache file system of the guest's own.
run modprobe brd rd_nr=1 rd_size=$((2560 * 1024))
run mkfs.ext4 -q -F /dev/ram0
mkdir -p "$LABDIR/scratch"
run mount /dev/ram0 "$LABDIR/scratch"
chmod 1777 "$LABDIR/scratch"

# The rdma runs' scratch: a tmpfs of its own (pinnable), unless rxe's ODP is trusted.
if [ "${RPMA_TRUST_RXE_ODP:-}" != trust ]; then
  mkdir -p "$LABDIR/rdma-scratch"
  run mount -t tmpfs -o size=1536m tmpfs "$LABDIR/rdma-scratch"
  export RPMA_TEST_RDMA_SCRATCH="$LABDIR/rdma-scratch"
fi

# Kernel block-device clients and what the mount tests use.
run modprobe nbd nbds_max=8
for m in loop fuse md_mod raid1 dm_mod nvme_tcp nvme_fabrics nvmet nvmet_tcp; do
  modprobe "$m" >/dev/null 2>&1 || true
done

export RPMA_VM_LAB=1
export RPMA_TEST_RDMA_DEVICE=rxe0 RPMA_TEST_RDMA_ADDR=10.99.0.1
export RPMA_TEST_DAX_DIR="$LABDIR/pmem" RPMA_TEST_DEVDAX=/dev/dax1.0
export RPMA_TEST_SCRATCH="$LABDIR/scratch" TMPDIR="$LABDIR/scratch"
echo "guest-lab: $(uname -r): rxe0 on dummy0 10.99.0.1 (active after ${rxe_wait} s)," \
  "fsdax $RPMA_TEST_DAX_DIR, devdax $RPMA_TEST_DEVDAX, scratch $RPMA_TEST_SCRATCH" >&2
exec "$@"
