//! What a controller says about itself and its namespaces: the Identify data structures
//! (controller, namespace, active namespace list, namespace identification descriptors) and the
//! small log pages (error information, SMART / health, firmware slot, changed namespace list).
//! Every structure is built into a zeroed buffer of its size at the offsets of the NVM Express
//! Base Specification; unsupported fields stay 0.
//!
//! Identifiers are stable: a namespace's NGUID and UUID are derived from its identity, the one
//! the native protocol's descriptor carries ([`crate::namespace::identity_of`]: the subsystem
//! NQN, the nsid and the file's inode and birth time), so the same file keeps them across
//! restarts, reloads and reboots, and another file at the same path (a restored copy moved into
//! place) is another namespace to the host; a subsystem's serial number is derived from its NQN.

use sha2::{Digest, Sha256};

use rpma_common::proto::nqn::Nqn;

/// Bytes of an Identify data structure.
pub const IDENTIFY_LEN: usize = 4096;

/// The model number every controller reports.
pub const MODEL: &str = "rpma-target";

/// NVMe version reported (VS and Identify Controller VER): 1.4.
pub const NVME_VERSION: u32 = 0x0001_0400;

/// CNS values this controller answers.
pub mod cns {
    /// Identify Namespace (NVM).
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller.
    pub const CONTROLLER: u8 = 0x01;
    /// Active Namespace ID list.
    pub const ACTIVE_NS_LIST: u8 = 0x02;
    /// Namespace Identification Descriptor list.
    pub const NS_DESCRIPTORS: u8 = 0x03;
    /// I/O Command Set specific Identify Namespace.
    pub const CS_NAMESPACE: u8 = 0x05;
    /// I/O Command Set specific Identify Controller.
    pub const CS_CONTROLLER: u8 = 0x06;
}

/// Log page identifiers this controller answers.
pub mod lid {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FIRMWARE: u8 = 0x03;
    /// Changed Namespace List.
    pub const CHANGED_NS: u8 = 0x04;
    /// Discovery (discovery controllers only).
    pub const DISCOVERY: u8 = 0x70;
}

/// Which kind of controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtrlKind {
    /// An I/O controller of an NVM subsystem.
    Io,
    /// A discovery controller.
    Discovery,
}

/// What Identify Controller reports.
#[derive(Debug, Clone)]
pub struct CtrlFacts {
    /// I/O or discovery.
    pub kind: CtrlKind,
    /// Controller id.
    pub cntlid: u16,
    /// The subsystem's NQN.
    pub subnqn: String,
    /// Serial number (at most 20 ASCII characters).
    pub serial: String,
    /// Firmware revision (at most 8 ASCII characters).
    pub firmware: String,
    /// MDTS: the largest transfer, as a power of two of 4 KiB pages.
    pub mdts: u8,
    /// MAXCMD: commands a host may have outstanding per queue.
    pub maxcmd: u16,
    /// A volatile write cache exists (Flush and FUA do something).
    pub vwc: bool,
    /// IOCCSZ: the I/O command capsule size in 16-byte units (64-byte command included).
    pub ioccsz: u32,
    /// Keep-alive granularity in units of 100 ms.
    pub kas: u16,
}

/// Writes `s` into `buf[at..at + len]`, padded with spaces (ASCII fields of Identify).
fn put_ascii(buf: &mut [u8], at: usize, len: usize, s: &str) {
    let field = &mut buf[at..at + len];
    field.fill(b' ');
    for (d, c) in field.iter_mut().zip(s.bytes().filter(u8::is_ascii_graphic)) {
        *d = c;
    }
}

/// Writes `s` NUL-padded into `buf[at..at + len]`, keeping a terminating NUL (NQN fields).
pub(crate) fn put_str(buf: &mut [u8], at: usize, len: usize, s: &str) {
    let field = &mut buf[at..at + len];
    field.fill(0);
    let n = s.len().min(len - 1);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn put16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn put128(buf: &mut [u8], at: usize, v: u128) {
    buf[at..at + 16].copy_from_slice(&v.to_le_bytes());
}

/// The serial number of `subsystem`'s controllers: 20 hex digits of a hash of its NQN, the
/// same for every controller of the subsystem (hosts group controllers by it).
pub fn serial_of(subsystem: &str) -> String {
    let h = Sha256::digest(format!("rpma nvme serial v1\0{subsystem}").as_bytes());
    h.iter().take(10).map(|b| format!("{b:02x}")).collect()
}

/// The NGUID and the (version 4 shaped) UUID of namespace `nsid` of `subsystem` whose
/// identity ([`OpenNamespace::identity`](crate::namespace::OpenNamespace::identity)) is
/// `identity`: which file it maps, not where. A host that reconnects to the same IDs takes the
/// namespace for the one it had (the Linux host keeps its block device, and its next Flush
/// stands for the writes it made before); to other IDs, for another one (it drops the block
/// device and adds a new one).
pub fn namespace_ids(subsystem: &Nqn, nsid: u32, identity: u64) -> ([u8; 16], [u8; 16]) {
    let mut h = Sha256::new();
    h.update(b"rpma nvme namespace v2\0");
    h.update(subsystem.as_str().as_bytes());
    h.update(b"\0");
    h.update(nsid.to_le_bytes());
    h.update(identity.to_le_bytes());
    let d = h.finalize();
    let mut nguid = [0u8; 16];
    nguid.copy_from_slice(&d[..16]);
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&d[16..32]);
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    (nguid, uuid)
}

/// Identify Controller.
pub fn controller(f: &CtrlFacts) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    put_ascii(&mut b, 4, 20, &f.serial);
    put_ascii(&mut b, 24, 40, MODEL);
    put_ascii(&mut b, 64, 8, &f.firmware);
    b[72] = 6; // RAB
    let io = f.kind == CtrlKind::Io;
    // CMIC: more than one port and more than one controller may serve the subsystem.
    b[76] = if io { 0x03 } else { 0 };
    b[77] = f.mdts;
    put16(&mut b, 78, f.cntlid);
    put32(&mut b, 80, NVME_VERSION);
    // OAES: Namespace Attribute Notices (I/O), Discovery Log Page Change (discovery).
    put32(&mut b, 92, if io { 1 << 8 } else { 1 << 31 });
    // CTRATT: 128-bit host identifiers (NVMe over Fabrics uses them).
    put32(&mut b, 96, 1);
    b[111] = if io { 1 } else { 2 }; // CNTRLTYPE
    b[258] = 3; // ACL: 4 Aborts
    b[259] = 3; // AERL: 4 Asynchronous Event Requests
    if io {
        b[260] = 0x03; // FRMW: one slot, read-only
    }
    b[261] = 1 << 2; // LPA: extended data (offsets) for Get Log Page
    put16(&mut b, 320, f.kas);
    if io {
        b[512] = 0x66; // SQES
        b[513] = 0x44; // CQES
    }
    put16(&mut b, 514, f.maxcmd);
    if io {
        put32(&mut b, 516, 0xffff_fffe); // NN
        put16(&mut b, 520, (1 << 2) | (1 << 3)); // ONCS: Dataset Management, Write Zeroes
                                                 // VWC: present (or not); Flush with NSID FFFFFFFFh supported either way.
        b[525] = 0x06 | u8::from(f.vwc);
    }
    // SGLS: SGLs supported; the address of a Data Block descriptor may be an offset.
    put32(&mut b, 536, 1 | (1 << 20));
    put_str(&mut b, 768, 256, &f.subnqn);
    if io {
        put32(&mut b, 1792, f.ioccsz);
        put32(&mut b, 1796, 1); // IORCSZ: 16 bytes
    }
    // ICDOFF 0, FCATT 0 (dynamic controller model), MSDBD 1, OFCS: Disconnect supported.
    b[1803] = 1;
    put16(&mut b, 1804, 1);
    b
}

/// What Identify Namespace reports.
#[derive(Debug, Clone, Copy)]
pub struct NsFacts {
    /// Size in bytes.
    pub size: u64,
    /// Block size (512 or 4096).
    pub block_size: u32,
    /// Writes are refused.
    pub read_only: bool,
    /// Its NGUID.
    pub nguid: [u8; 16],
}

/// Identify Namespace (NVM command set).
pub fn namespace(n: &NsFacts) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let blocks = n.size / u64::from(n.block_size.max(1));
    put64(&mut b, 0, blocks); // NSZE
    put64(&mut b, 8, blocks); // NCAP
    put64(&mut b, 16, blocks); // NUSE
                               // NLBAF 0 (one format), FLBAS 0.
    b[30] = 1; // NMIC: may be attached to two or more controllers
               // DLFEAT: deallocated blocks read as zeros; Write Zeroes may deallocate.
    b[33] = 0x01 | 0x08;
    put128(&mut b, 48, u128::from(n.size)); // NVMCAP
    b[99] = u8::from(n.read_only); // NSATTR: write protected
    b[104..120].copy_from_slice(&n.nguid);
    // LBAF0: no metadata, LBADS = log2(block size), best relative performance.
    let lbads = n.block_size.max(1).trailing_zeros();
    put32(&mut b, 128, lbads << 16);
    b
}

/// The Active Namespace ID list: the ids in `active` greater than `after`, ascending, at most
/// 1024.
pub fn active_ns_list(active: impl IntoIterator<Item = u32>, after: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let mut ids: Vec<u32> = active.into_iter().filter(|&n| n > after).collect();
    ids.sort_unstable();
    for (i, id) in ids.into_iter().take(IDENTIFY_LEN / 4).enumerate() {
        put32(&mut b, i * 4, id);
    }
    b
}

/// The Namespace Identification Descriptor list: NGUID, UUID, and the command set (NVM).
pub fn ns_descriptors(nguid: &[u8; 16], uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let mut at = 0;
    for (nidt, nid) in [(2u8, &nguid[..]), (3u8, &uuid[..]), (4u8, &[0u8][..])] {
        b[at] = nidt;
        b[at + 1] = nid.len() as u8;
        b[at + 4..at + 4 + nid.len()].copy_from_slice(nid);
        at += 4 + nid.len();
    }
    b
}

/// What the SMART / Health log reports (controller-wide).
#[derive(Debug, Clone, Copy, Default)]
pub struct Health {
    /// A namespace has failed: reliability is degraded (critical warning bit 2).
    pub degraded: bool,
    /// Bytes read by hosts.
    pub read_bytes: u64,
    /// Bytes written by hosts.
    pub write_bytes: u64,
    /// Read commands.
    pub reads: u64,
    /// Write commands.
    pub writes: u64,
}

/// The SMART / Health Information log page (512 bytes). Temperature and wear are not measured
/// (0): rpma has no sensors of its own to report.
pub fn smart(h: &Health) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[0] = if h.degraded { 1 << 2 } else { 0 };
    b[3] = 100; // available spare
    b[4] = 10; // available spare threshold
               // Data units are thousands of 512-byte units, rounded up.
    let units = |bytes: u64| u128::from(bytes.div_ceil(512 * 1000));
    put128(&mut b, 32, units(h.read_bytes));
    put128(&mut b, 48, units(h.write_bytes));
    put128(&mut b, 64, u128::from(h.reads));
    put128(&mut b, 80, u128::from(h.writes));
    b
}

/// The NVM command set's Identify Controller structure (CNS 06h, CSI 0): the limits of the
/// zeroing commands. `wzsl`: the largest Write Zeroes, 2^wzsl pages of 4 KiB; `dm_blocks`: the
/// most logical blocks one Dataset Management deallocation may cover, in a range (DMRSL) and
/// in all (DMSL). No limit on the number of ranges (DMRL 0: the command's own 256).
pub fn nvm_controller(wzsl: u8, dm_blocks: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    b[1] = wzsl;
    b[4..8].copy_from_slice(&dm_blocks.to_le_bytes());
    b[8..16].copy_from_slice(&u64::from(dm_blocks).to_le_bytes());
    b
}

/// The Firmware Slot Information log page (512 bytes): slot 1 active, running `firmware`.
pub fn firmware_slots(firmware: &str) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[0] = 1;
    put_ascii(&mut b, 8, 8, firmware);
    b
}

/// The Changed Namespace List log page (4096 bytes): up to 1024 ids, or FFFFFFFFh first when
/// more changed.
pub fn changed_ns_list(changed: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    if changed.len() > IDENTIFY_LEN / 4 {
        put32(&mut b, 0, 0xffff_ffff);
    } else {
        for (i, id) in changed.iter().enumerate() {
            put32(&mut b, i * 4, *id);
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(kind: CtrlKind) -> CtrlFacts {
        CtrlFacts {
            kind,
            cntlid: 0x1234,
            subnqn: "nqn.2026-11.io.rpma:demo".into(),
            serial: serial_of("nqn.2026-11.io.rpma:demo"),
            firmware: "0.1.0".into(),
            mdts: 5,
            maxcmd: 128,
            vwc: true,
            ioccsz: 516,
            kas: 10,
        }
    }

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }

    #[test]
    fn identify_controller_has_what_the_linux_host_checks() {
        let b = controller(&facts(CtrlKind::Io));
        assert_eq!(b.len(), 4096);
        assert_eq!(u16_at(&b, 78), 0x1234, "CNTLID matches the Connect");
        assert_eq!(&b[24..35], b"rpma-target");
        assert_eq!(b[63], b' ', "MN is space padded");
        assert_eq!(b[77], 5, "MDTS");
        assert_eq!(u32_at(&b, 80), NVME_VERSION);
        assert_eq!(b[111], 1, "I/O controller");
        assert_ne!(
            u16_at(&b, 320),
            0,
            "KAS: keep-alive is mandatory on fabrics"
        );
        assert_eq!(u16_at(&b, 514), 128, "MAXCMD");
        assert_eq!(b[525] & 1, 1, "VWC present");
        assert_eq!(u32_at(&b, 536) & 3, 1, "SGLs supported");
        assert_ne!(u32_at(&b, 536) & (1 << 20), 0, "in-capsule offsets");
        assert_eq!(&b[768..792], b"nqn.2026-11.io.rpma:demo");
        assert_eq!(b[792], 0, "NQN is NUL terminated");
        assert_eq!(u32_at(&b, 1792), 516, "IOCCSZ");
        assert_eq!(
            u16_at(&b, 1800),
            0,
            "ICDOFF: the Linux host refuses any other"
        );
        assert_eq!(u16_at(&b, 520) & 0x0c, 0x0c, "DSM and Write Zeroes");
        let no_cache = controller(&CtrlFacts {
            vwc: false,
            ..facts(CtrlKind::Io)
        });
        assert_eq!(no_cache[525] & 1, 0);
        let d = controller(&facts(CtrlKind::Discovery));
        assert_eq!(d[111], 2, "discovery controller");
        assert_eq!(u32_at(&d, 92), 1 << 31);
    }

    #[test]
    fn serials_are_stable_per_subsystem() {
        let a = serial_of("nqn.2026-11.io.rpma:a");
        assert_eq!(a.len(), 20);
        assert_eq!(a, serial_of("nqn.2026-11.io.rpma:a"));
        assert_ne!(a, serial_of("nqn.2026-11.io.rpma:b"));
    }

    #[test]
    fn namespace_ids_are_stable_and_distinct() {
        let s = Nqn::new("nqn.2026-11.io.rpma:a").unwrap();
        let (g1, u1) = namespace_ids(&s, 1, 7);
        assert_eq!((g1, u1), namespace_ids(&s, 1, 7), "stable");
        assert_ne!(g1, namespace_ids(&s, 2, 7).0, "per nsid");
        assert_ne!(g1, namespace_ids(&s, 1, 8).0, "per backing file");
        let other = Nqn::new("nqn.2026-11.io.rpma:b").unwrap();
        assert_ne!(g1, namespace_ids(&other, 1, 7).0, "per subsystem");
        assert_eq!(u1[6] >> 4, 4, "UUID version 4");
        assert_eq!(u1[8] >> 6, 2, "UUID variant");
    }

    #[test]
    fn identify_namespace_sizes_and_format() {
        let b = namespace(&NsFacts {
            size: 64 << 20,
            block_size: 512,
            read_only: true,
            nguid: [7; 16],
        });
        assert_eq!(
            u64::from_le_bytes(b[0..8].try_into().unwrap()),
            (64 << 20) / 512
        );
        assert_eq!(b[26], 0, "FLBAS");
        assert_eq!((u32_at(&b, 128) >> 16) & 0xff, 9, "LBADS 512");
        assert_eq!(b[99], 1, "write protected");
        assert_eq!(&b[104..120], &[7; 16]);
        let b = namespace(&NsFacts {
            size: 1 << 20,
            block_size: 4096,
            read_only: false,
            nguid: [0; 16],
        });
        assert_eq!((u32_at(&b, 128) >> 16) & 0xff, 12, "LBADS 4096");
        assert_eq!(b[99], 0);
    }

    #[test]
    fn lists_and_descriptors() {
        let b = active_ns_list([5, 1, 3], 1);
        assert_eq!((u32_at(&b, 0), u32_at(&b, 4), u32_at(&b, 8)), (3, 5, 0));
        let d = ns_descriptors(&[1; 16], &[2; 16]);
        assert_eq!((d[0], d[1]), (2, 16));
        assert_eq!(&d[4..20], &[1; 16]);
        assert_eq!((d[20], d[21]), (3, 16));
        assert_eq!(&d[24..40], &[2; 16]);
        assert_eq!((d[40], d[41], d[44]), (4, 1, 0), "CSI NVM");
        assert_eq!(d[48], 0, "terminated");
        let many: Vec<u32> = (1..=1025).collect();
        assert_eq!(u32_at(&changed_ns_list(&many), 0), 0xffff_ffff);
        assert_eq!(u32_at(&changed_ns_list(&[4, 9]), 4), 9);
    }

    #[test]
    fn smart_counts_in_data_units() {
        let b = smart(&Health {
            degraded: true,
            read_bytes: 512_001,
            write_bytes: 512_000 * 3,
            reads: 7,
            writes: 8,
        });
        assert_eq!(b[0], 4);
        assert_eq!(b[32], 2, "rounded up");
        assert_eq!(b[48], 3);
        assert_eq!((b[64], b[80]), (7, 8));
    }
}
