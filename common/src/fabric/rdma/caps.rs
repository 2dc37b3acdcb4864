//! What an RDMA device can do ([`Caps`]), queried once when it is opened, and which of it must
//! not be used: Soft-RoCE's on-demand paging misplaces data unless the operator trusts a fixed
//! kernel.

use std::os::raw::c_int;
use std::ptr::NonNull;

use rdma_sys::{
    ibv_atomic_cap, ibv_context, ibv_device_attr_ex, ibv_device_cap_flags, ibv_odp_general_caps,
};

use super::ext;
use super::sys::{self, cap_ex};
use crate::fabric::error::Result;

/// What a device can do, queried once when it is opened.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub(crate) max_qp_wr: u32,
    pub(crate) max_cqe: u32,
    /// Most Reads/atomics this side serves at once per queue pair (responder resources).
    pub(crate) max_qp_rd_atom: u8,
    /// Most Reads/atomics this side keeps in flight per queue pair (initiator depth).
    pub(crate) max_qp_init_rd_atom: u8,
    pub(crate) atomics: bool,
    pub(crate) atomic_write: bool,
    pub(crate) mw_type2: bool,
    /// On-demand paging: supported at all, and the RC operations it covers
    /// (`IBV_ODP_SUPPORT_*`).
    pub(crate) odp: bool,
    pub(crate) odp_rc: u32,
    /// Why the device's ODP, though reported, must not be used (it misplaces data); None
    /// where it may be.
    pub(crate) odp_defect: Option<&'static str>,
}

/// `vendor_id` of Soft-RoCE (the kernel's `RXE_VENDOR_ID`).
const RXE_VENDOR_ID: u32 = 0xFF_FFFF;

/// Set to `trust` to use Soft-RoCE's on-demand paging anyway (a kernel whose rxe ODP copy
/// is fixed: docs/rdma.md says how to check one).
pub(crate) const TRUST_RXE_ODP_VAR: &str = "RPMA_TRUST_RXE_ODP";

/// Soft-RoCE's ODP copy (`__rxe_odp_mr_copy`, Linux 6.17 to 7.3 at least) ignores the offset
/// within a page: a Write placed at byte 2048 of a page lands at byte 0, and a Write across
/// pages repeats its first bytes. Registering a namespace with it would corrupt it silently.
pub(crate) const RXE_ODP_DEFECT: &str = "Soft-RoCE's on-demand paging places data at the wrong \
     offset within a page (a defect of the kernel's rxe ODP copy: docs/rdma.md, \
     \"Soft-RoCE and ODP\"), so it is not used";

/// Whether ODP of a device with `vendor_id` is known to misplace data, unless the operator
/// says to trust it (`RPMA_TRUST_RXE_ODP=trust`, for a fixed kernel).
fn odp_defect(vendor_id: u32, trust: Option<&str>) -> Option<&'static str> {
    (vendor_id == RXE_VENDOR_ID && trust != Some("trust")).then_some(RXE_ODP_DEFECT)
}

pub(crate) fn query_caps(ctx: NonNull<ibv_context>) -> Result<Caps> {
    // SAFETY: ibv_device_attr_ex is plain C data; zero is a valid value of every field (the
    // query fills what the device reports, rdma-sys does not clear it first).
    let mut attr: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    // SAFETY: the context is open; `attr` is a valid out-parameter. Not rdma-sys's wrapper,
    // which never finds the provider's op (ext.rs).
    let r = unsafe { ext::query_device_ex(ctx.as_ptr(), &mut attr) };
    if r != 0 {
        return Err(sys::returned("ibv_query_device_ex", r));
    }
    let a = &attr.orig_attr;
    let flags = ibv_device_cap_flags(a.device_cap_flags);
    let has = |f: ibv_device_cap_flags| flags.0 & f.0 != 0;
    let u8_of = |v: c_int| v.clamp(0, 255) as u8;
    Ok(Caps {
        max_qp_wr: a.max_qp_wr.max(1) as u32,
        max_cqe: a.max_cqe.max(1) as u32,
        max_qp_rd_atom: u8_of(a.max_qp_rd_atom),
        max_qp_init_rd_atom: u8_of(a.max_qp_init_rd_atom),
        atomics: a.atomic_cap != ibv_atomic_cap::IBV_ATOMIC_NONE,
        atomic_write: attr.device_cap_flags_ex & cap_ex::ATOMIC_WRITE != 0,
        mw_type2: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A)
            || has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B),
        odp: attr.odp_caps.general_caps & u64::from(ibv_odp_general_caps::IBV_ODP_SUPPORT.0) != 0,
        odp_rc: attr.odp_caps.per_transport_caps.rc_odp_caps,
        odp_defect: odp_defect(
            a.vendor_id,
            std::env::var(TRUST_RXE_ODP_VAR).ok().as_deref(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::rdma::device::Device;

    /// What `ibv_devinfo -v` prints of a device's ODP caps and extended capability flags:
    /// (general ODP support, RC ODP caps, device_cap_flags_ex).
    fn devinfo_caps(text: &str) -> (bool, u32, u64) {
        const RC_BITS: [(&str, u32); 6] = [
            ("SUPPORT_SEND", 1),
            ("SUPPORT_RECV", 2),
            ("SUPPORT_WRITE", 4),
            ("SUPPORT_READ", 8),
            ("SUPPORT_ATOMIC", 16),
            ("SUPPORT_SRQ", 32),
        ];
        let (mut odp, mut rc, mut flags_ex) = (false, 0u32, 0u64);
        let mut section = "";
        for line in text.lines() {
            let t = line.trim();
            if let Some((key, value)) = t.split_once(':') {
                if !value.trim().is_empty() && key == "device_cap_flags_ex" {
                    let hex = value.trim().trim_start_matches("0x");
                    flags_ex = u64::from_str_radix(hex, 16).expect("device_cap_flags_ex");
                }
                if key != "Unknown flags" {
                    section = key;
                    continue;
                }
                if section == "rc_odp_caps" {
                    let hex = value.trim().trim_start_matches("0x");
                    rc |= u32::from_str_radix(hex, 16).expect("unknown rc_odp_caps flags");
                }
                continue;
            }
            match section {
                "general_odp_caps" if t == "ODP_SUPPORT" => odp = true,
                "rc_odp_caps" => {
                    rc |= RC_BITS.iter().find(|(n, _)| *n == t).map_or(0, |(_, b)| *b);
                }
                _ => {}
            }
        }
        (odp, rc, flags_ex)
    }

    #[test]
    fn soft_roce_odp_is_not_trusted_unless_the_operator_says_so() {
        assert_eq!(odp_defect(RXE_VENDOR_ID, None), Some(RXE_ODP_DEFECT));
        assert_eq!(odp_defect(RXE_VENDOR_ID, Some("yes")), Some(RXE_ODP_DEFECT));
        assert_eq!(odp_defect(RXE_VENDOR_ID, Some("trust")), None);
        // Mellanox (0x02c9) and others: as they report.
        assert_eq!(odp_defect(0x02c9, None), None);
    }

    #[test]
    fn ibv_devinfo_text_is_read_as_the_device_reports_it() {
        let text = "\tgeneral_odp_caps:\n\t\t\t\t\tODP_SUPPORT\n\trc_odp_caps:\n\t\t\t\t\tSUPPORT_SEND\n\t\t\t\t\tSUPPORT_WRITE\n\t\t\t\t\tSUPPORT_ATOMIC\n\t\t\t\t\tUnknown flags: 0xC0\n\tuc_odp_caps:\n\t\t\t\t\tNO SUPPORT\n\tud_odp_caps:\n\t\t\t\t\tSUPPORT_READ\n\tdevice_cap_flags_ex:\t\t0x1C001223C76\n\t\t\t\t\tUnknown flags: 0x1C000000000\n";
        assert_eq!(devinfo_caps(text), (true, 1 | 4 | 16 | 0xc0, 0x1C001223C76));
        assert_eq!(
            devinfo_caps("\tgeneral_odp_caps:\n\trc_odp_caps:\n\t\tNO SUPPORT\n"),
            (false, 0, 0)
        );
    }

    /// The capabilities this transport reads (through ext.rs, not rdma-sys's wrapper, which
    /// reads no ODP and no extended flags on any device) are the ones rdma-core's own
    /// `ibv_devinfo -v` prints for the device: ODP, its RC rights, Atomic Write.
    #[test]
    #[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE)"]
    fn caps_are_what_ibv_devinfo_reports() {
        let name = std::env::var("RPMA_TEST_RDMA_DEVICE")
            .expect("set RPMA_TEST_RDMA_DEVICE to the device to check (docs/rdma.md)");
        let out = std::process::Command::new("ibv_devinfo")
            .args(["-v", "-d", &name])
            .output()
            .expect("ibv_devinfo (ibverbs-utils) runs");
        assert!(out.status.success(), "ibv_devinfo -d {name}: {out:?}");
        let (odp, rc, flags_ex) = devinfo_caps(&String::from_utf8_lossy(&out.stdout));
        let dev = Device::by_name(&name).unwrap();
        let caps = dev.caps();
        assert_eq!(caps.odp, odp, "general ODP support of {name}");
        assert_eq!(caps.odp_rc, rc, "RC ODP caps of {name}");
        assert_eq!(
            caps.atomic_write,
            flags_ex & cap_ex::ATOMIC_WRITE != 0,
            "Atomic Write of {name} (device_cap_flags_ex {flags_ex:#x})"
        );
    }
}
