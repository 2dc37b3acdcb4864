#!/bin/bash
# Runs the nvme-tcp:// listener's VM-lab tests (tests/tests/nvme_tcp_vm.rs, #[ignore]d on the
# build host, whose kernel has no nvme-tcp) inside a guest booted with virtme-ng on the build
# host's own userspace: the kernel's NVMe/TCP host and nvme-cli against this tree's rpma-target.
#
#   scripts/vm-nvme-tcp.sh [TEST-FILTER]      (VM_KERNEL, VNG_VENV, VM_CPUS, VM_MEMORY, VM_KVM)
#
# Needs: vng (virtme-ng) on PATH or in $VNG_VENV, a kernel with nvme-tcp as modules beside it
# ($VM_KERNEL), nvme-cli, fio, e2fsprogs. The guest runs the test binary already built here
# (its /work is the host's, read-only: every file a test writes goes to the guest's /tmp);
# the exit status is the tests'. When the lab's scripts/vm-run.sh exists, it runs these with
# every other ignored test; this script stays for running only these.
set -euo pipefail
cd "$(dirname "$0")/.."

VNG_VENV=${VNG_VENV:-/tmp/vngvenv}
VM_KERNEL=${VM_KERNEL:-/tmp/kapt/root/usr/lib/modules/7.3.4+deb13-amd64/vmlinuz}
VM_CPUS=${VM_CPUS:-2}
VM_MEMORY=${VM_MEMORY:-4G}
FILTER=${1:-vm_}
export PATH="$VNG_VENV/bin:$PATH"

command -v vng >/dev/null || { echo "vng (virtme-ng) not found: set VNG_VENV" >&2; exit 2; }
[ -e "$VM_KERNEL" ] || { echo "no kernel at $VM_KERNEL: set VM_KERNEL" >&2; exit 2; }

cargo build --quiet --workspace --all-features
bin=$(cargo test --quiet --no-run --all-features -p rpma-tests --test nvme_tcp_vm \
    --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -1)
[ -x "$bin" ] || { echo "the test binary was not built" >&2; exit 2; }

# The guest writes the tests' output to a directory shared read-write (the console mangles
# long output), its exit status and its kernel log beside it.
out=$(mktemp -d /tmp/rpma-vm-nvme-tcp.XXXXXX)
trap 'rm -rf "$out"' EXIT
cat > "$out/guest.sh" <<EOF
#!/bin/bash
ip link set lo up
cd "$PWD"
RUST_BACKTRACE=1 "$bin" --ignored --test-threads=1 --nocapture "$FILTER" > /tmp/out/tests.log 2>&1
echo \$? > /tmp/out/status
dmesg > /tmp/out/dmesg.log
EOF
chmod +x "$out/guest.sh"

# TCG by default (these hosts' /dev/kvm does not work nested); VM_KVM=1 where KVM does. Under
# TCG the guest is slow: figures from it are ratios only.
kvm=--disable-kvm
[ "${VM_KVM:-0}" = 1 ] && kvm=
timeout 1800 vng --run "$VM_KERNEL" $kvm --cpus "$VM_CPUS" --memory "$VM_MEMORY" \
    --rwdir "/tmp/out=$out" --exec "$out/guest.sh" > "$out/console.log" 2>&1 || true
cat "$out/tests.log" 2>/dev/null || { cat "$out/console.log"; exit 2; }
if [ -n "${VM_DMESG:-}" ]; then cp "$out/dmesg.log" "$VM_DMESG"; fi
exit "$(cat "$out/status" 2>/dev/null || echo 2)"
