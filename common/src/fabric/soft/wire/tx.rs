//! Transmit side: cutting a message into FPDUs (DDP segmentation) and framing them (MPA length,
//! padding, CRC32c), without copying the payload.
//!
//! A [`Segmenter`] walks a scatter-gather payload and yields one [`TxFpdu`] per DDP segment:
//! the 2-byte length plus the DDP/RDMAP header (`head`), the payload as borrowed slices straight
//! from the caller's (registered) memory, and the pad + CRC (`trailer`): three pieces for
//! `writev`. Each segment's header is the template advanced by the bytes already sent (TO for
//! tagged, MO for untagged); the last one carries L.

use std::io::{self, IoSlice, Write};

use super::crc::{crc32c, crc32c_append, crc32c_append_volatile, prefetch_pages};
use super::ddp::{Header, UNTAGGED_HDR_LEN};
use super::error::{Result, WireError};
use super::{pad_len, DEFAULT_MAX_ULPDU, MAX_ULPDU_LIMIT};
use crate::volatile::VolatileSlice;

/// The smallest maximum ULPDU accepted by [`TxConfig`] and the receiver's configuration: room
/// for an untagged header and the largest control body (52 bytes), with margin.
pub const MIN_MAX_ULPDU: usize = 128;

/// Settings of the transmit side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxConfig {
    crc: bool,
    max_ulpdu: usize,
}

impl TxConfig {
    /// `crc`: compute CRC32c (else send zeros); `max_ulpdu`: the most bytes of header + payload
    /// per FPDU (see [`DEFAULT_MAX_ULPDU`]; up to 65535 on loopback).
    ///
    /// # Errors
    /// [`WireError::InvalidConfig`] if `max_ulpdu` is outside `MIN_MAX_ULPDU..=65535`.
    pub fn new(crc: bool, max_ulpdu: usize) -> Result<TxConfig> {
        if !(MIN_MAX_ULPDU..=MAX_ULPDU_LIMIT).contains(&max_ulpdu) {
            return Err(WireError::InvalidConfig {
                what: "max ULPDU outside 128..=65535",
            });
        }
        Ok(TxConfig { crc, max_ulpdu })
    }

    /// Whether CRC32c is computed.
    pub fn crc(&self) -> bool {
        self.crc
    }

    /// The maximum ULPDU length.
    pub fn max_ulpdu(&self) -> usize {
        self.max_ulpdu
    }
}

impl Default for TxConfig {
    fn default() -> Self {
        TxConfig {
            crc: true,
            max_ulpdu: DEFAULT_MAX_ULPDU,
        }
    }
}

const HEAD_MAX: usize = 2 + UNTAGGED_HDR_LEN;

/// The framing of one FPDU around its payload: the MPA length and the DDP/RDMAP header in
/// front (`head`), the pad and the CRC behind (`trailer`). Owns its bytes, so a transmit queue
/// can keep it beside a payload it owns in its own way (the engine's FPDUs keep an `Arc` of
/// the registered region).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framing {
    head: [u8; HEAD_MAX],
    head_len: u8,
    trailer: [u8; 7],
    trailer_len: u8,
}

impl Framing {
    /// Frames `header` (exactly as given, `last` included) around a payload of `payload_len`
    /// bytes given as `pieces` (used only for the CRC, when `crc`).
    pub fn new<'p>(
        header: &Header,
        payload_len: usize,
        pieces: impl IntoIterator<Item = &'p [u8]>,
        crc: bool,
    ) -> Framing {
        Framing::build(header, payload_len, crc, |mut c| {
            for p in pieces {
                // The payload usually comes straight from registered memory that the CPU has
                // not touched lately (the CRC is the first pass over it).
                prefetch_pages(p);
                c = crc32c_append(c, p);
            }
            c
        })
    }

    /// Frames `header` around `payload`, registered memory that others may be writing (a
    /// Write's source, a Read Response's): the CRC, when `crc`, is computed over copies of it
    /// ([`crc32c_append_volatile`]), never through a reference.
    pub fn for_volatile(header: &Header, payload: VolatileSlice<'_>, crc: bool) -> Framing {
        Framing::build(header, payload.len(), crc, |c| {
            crc32c_append_volatile(c, payload)
        })
    }

    /// `payload_crc` continues a CRC over the payload's bytes; called only when `crc`.
    fn build(
        header: &Header,
        payload_len: usize,
        crc: bool,
        payload_crc: impl FnOnce(u32) -> u32,
    ) -> Framing {
        let ulpdu_len = header.len() + payload_len;
        let mut head = [0u8; HEAD_MAX];
        head[..2].copy_from_slice(&(ulpdu_len as u16).to_be_bytes());
        let head_len = 2 + header.encode_into(&mut head[2..]);
        let pad = pad_len(ulpdu_len);
        let mut trailer = [0u8; 7];
        if crc {
            let mut c = payload_crc(crc32c(&head[..head_len]));
            c = crc32c_append(c, &trailer[..pad]);
            trailer[pad..pad + 4].copy_from_slice(&c.to_le_bytes());
        }
        Framing {
            head,
            head_len: head_len as u8,
            trailer,
            trailer_len: (pad + 4) as u8,
        }
    }

    /// MPA length + DDP/RDMAP header bytes.
    pub fn head(&self) -> &[u8] {
        &self.head[..self.head_len as usize]
    }

    /// Padding (0-3 zero bytes) + CRC (4 bytes, least significant first; zeros without CRC).
    pub fn trailer(&self) -> &[u8] {
        &self.trailer[..self.trailer_len as usize]
    }

    /// Head and trailer bytes: the FPDU's length on the wire less its payload.
    pub fn overhead(&self) -> usize {
        self.head_len as usize + self.trailer_len as usize
    }
}

/// The segments of one message, as (header, payload offset, payload length), without its
/// payload: the owned core of [`Segmenter`], for transmit queues that keep their payloads in
/// their own way. Each header is the template advanced by the bytes before it (TO for tagged,
/// MO for untagged); the last carries L. A zero-length message is one segment.
#[derive(Clone, Copy, Debug)]
pub struct Cuts {
    template: Header,
    total: usize,
    sent: usize,
    max_payload: usize,
    done: bool,
}

impl Cuts {
    /// Cuts `total` payload bytes behind `template` (its `last` flag is ignored) into segments
    /// of at most `cfg.max_ulpdu()` bytes of header and payload.
    pub fn new(template: Header, total: usize, cfg: &TxConfig) -> Cuts {
        Cuts {
            template,
            total,
            sent: 0,
            max_payload: cfg.max_ulpdu - template.len(),
            done: false,
        }
    }

    /// Payload bytes per full segment.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// How many segments the whole message takes.
    pub fn count(&self) -> usize {
        self.total.div_ceil(self.max_payload).max(1)
    }

    /// Payload bytes already handed out.
    pub fn sent(&self) -> usize {
        self.sent
    }
}

impl Iterator for Cuts {
    type Item = (Header, usize, usize);

    fn next(&mut self) -> Option<(Header, usize, usize)> {
        if self.done {
            return None;
        }
        let n = (self.total - self.sent).min(self.max_payload);
        let mut header = self.template.advanced(self.sent);
        header.last = self.sent + n == self.total;
        let at = self.sent;
        self.sent += n;
        self.done = header.last;
        Some((header, at, n))
    }
}

/// One FPDU ready to send: `head`, then the payload slices, then `trailer`.
#[derive(Clone, Debug)]
pub struct TxFpdu<'a> {
    header: Header,
    framing: Framing,
    sg: &'a [&'a [u8]],
    first: (usize, usize),
    payload_len: usize,
}

impl<'a> TxFpdu<'a> {
    /// The DDP/RDMAP header of this segment.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// MPA length + DDP/RDMAP header bytes.
    pub fn head(&self) -> &[u8] {
        self.framing.head()
    }

    /// Padding (0-3 zero bytes) + CRC (4 bytes, least significant first; zeros without CRC).
    pub fn trailer(&self) -> &[u8] {
        self.framing.trailer()
    }

    /// The payload bytes of this segment.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// The payload as slices of the caller's buffers, in order.
    pub fn payload(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        pieces(self.sg, self.first, self.payload_len)
    }

    /// Bytes on the wire.
    pub fn wire_len(&self) -> usize {
        self.framing.overhead() + self.payload_len
    }

    /// Appends the pieces as `IoSlice`s for `write_vectored`.
    pub fn io_slices<'s>(&'s self, out: &mut Vec<IoSlice<'s>>) {
        out.push(IoSlice::new(self.head()));
        out.extend(self.payload().filter(|p| !p.is_empty()).map(IoSlice::new));
        out.push(IoSlice::new(self.trailer()));
    }

    /// Writes the FPDU to a blocking writer (tests and simple tools; the engine uses
    /// [`TxFpdu::io_slices`] with its own partial-write bookkeeping).
    ///
    /// # Errors
    /// Those of `w`.
    pub fn write_to<W: Write>(&self, w: &mut W) -> io::Result<()> {
        w.write_all(self.head())?;
        for p in self.payload() {
            w.write_all(p)?;
        }
        w.write_all(self.trailer())
    }

    /// Appends the FPDU's bytes to `out` (a copy; for control messages and tests).
    pub fn append_to(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.head());
        for p in self.payload() {
            out.extend_from_slice(p);
        }
        out.extend_from_slice(self.trailer());
    }
}

fn pieces<'a>(
    sg: &'a [&'a [u8]],
    first: (usize, usize),
    len: usize,
) -> impl Iterator<Item = &'a [u8]> + 'a {
    let (mut idx, mut off) = first;
    let mut left = len;
    std::iter::from_fn(move || {
        while left > 0 {
            let s = sg.get(idx)?;
            if off >= s.len() {
                idx += 1;
                off = 0;
                continue;
            }
            let n = (s.len() - off).min(left);
            let piece = &s[off..off + n];
            off += n;
            left -= n;
            return Some(piece);
        }
        None
    })
}

/// Cuts one message into FPDUs. Create with [`segment`].
#[derive(Clone, Debug)]
pub struct Segmenter<'a> {
    cuts: Cuts,
    sg: &'a [&'a [u8]],
    crc: bool,
    pos: (usize, usize),
}

/// Segments a message whose first segment has header `template` (TO or MO of the first byte;
/// its `last` flag is ignored) and whose payload is the concatenation of `payload`. A zero-length
/// message yields one FPDU.
pub fn segment<'a>(template: Header, payload: &'a [&'a [u8]], cfg: &TxConfig) -> Segmenter<'a> {
    let total = payload.iter().map(|s| s.len()).sum();
    Segmenter {
        cuts: Cuts::new(template, total, cfg),
        sg: payload,
        crc: cfg.crc,
        pos: (0, 0),
    }
}

impl<'a> Segmenter<'a> {
    /// Payload bytes per full segment with this template.
    pub fn max_payload(&self) -> usize {
        self.cuts.max_payload()
    }

    /// How many FPDUs the whole message takes.
    pub fn fpdu_count(&self) -> usize {
        self.cuts.count()
    }
}

impl<'a> Iterator for Segmenter<'a> {
    type Item = TxFpdu<'a>;

    fn next(&mut self) -> Option<TxFpdu<'a>> {
        let (header, _, n) = self.cuts.next()?;
        let first = self.pos;
        // Advance the scatter-gather position by n.
        let mut left = n;
        while left > 0 {
            let s_len = self.sg[self.pos.0].len();
            let take = (s_len - self.pos.1).min(left);
            left -= take;
            self.pos.1 += take;
            if self.pos.1 == s_len {
                self.pos = (self.pos.0 + 1, 0);
            }
        }
        Some(frame(header, self.sg, first, n, self.crc))
    }
}

fn frame<'a>(
    header: Header,
    sg: &'a [&'a [u8]],
    first: (usize, usize),
    payload_len: usize,
    crc: bool,
) -> TxFpdu<'a> {
    TxFpdu {
        header,
        framing: Framing::new(&header, payload_len, pieces(sg, first, payload_len), crc),
        sg,
        first,
        payload_len,
    }
}

/// Frames one FPDU with exactly `header` (its `last` flag as given) around `body`, appending the
/// bytes to `out`; returns the bytes appended. For control messages (Read Request, Terminate,
/// atomics, the private opcodes) and for tests.
///
/// # Errors
/// [`WireError::UlpduTooLong`] if header + body exceed 65535 bytes.
pub fn encode_fpdu(header: &Header, body: &[u8], crc: bool, out: &mut Vec<u8>) -> Result<usize> {
    let ulpdu_len = header.len() + body.len();
    if ulpdu_len > MAX_ULPDU_LIMIT {
        return Err(WireError::UlpduTooLong {
            ulpdu_len,
            max: MAX_ULPDU_LIMIT,
        });
    }
    let sg = [body];
    let f = frame(*header, &sg, (0, 0), body.len(), crc);
    let before = out.len();
    f.append_to(out);
    Ok(out.len() - before)
}

#[cfg(test)]
mod tests {
    use super::super::ddp::{HeaderKind, Opcode};
    use super::super::{crc32c, fpdu_len};
    use super::*;

    #[test]
    fn send_fpdu_with_crc_golden() {
        // Send "hello", MSN 1, CRC on. ULPDU 18 + 5 = 23 bytes, pad 3. The CRC was computed
        // independently (bitwise CRC32c in Python) over the 28 bytes before it.
        let mut out = Vec::new();
        let h = Header::untagged(Opcode::Send, 1, true);
        let n = encode_fpdu(&h, b"hello", true, &mut out).unwrap();
        let want: &[u8] = &[
            0x00, 0x17, // ULPDU length 23
            0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, // Send, QN 0, MSN 1
            b'h', b'e', b'l', b'l', b'o', 0, 0, 0, // payload, pad 3
            0xB9, 0x90, 0xB1, 0x0C, // CRC32c 0x0CB190B9, least significant byte first
        ];
        assert_eq!(out, want);
        assert_eq!(n, 32);
        assert_eq!(crc32c(&want[..28]).to_le_bytes(), want[28..]);
        // Without CRC: the same bytes, CRC zeroed.
        let mut plain = Vec::new();
        encode_fpdu(&h, b"hello", false, &mut plain).unwrap();
        assert_eq!(&plain[..28], &want[..28]);
        assert_eq!(&plain[28..], &[0, 0, 0, 0]);
    }

    #[test]
    fn write_segments_advance_to_and_set_last() {
        let data: Vec<u8> = (0..=255u8).cycle().take(300).collect();
        let (a, b) = data.split_at(100);
        let sg = [a, b];
        let cfg = TxConfig::new(true, 128).unwrap(); // 114 payload bytes per tagged segment
        let seg = segment(Header::tagged(Opcode::Write, 7, 0x1000, false), &sg, &cfg);
        assert_eq!(seg.max_payload(), 114);
        assert_eq!(seg.fpdu_count(), 3);
        let fpdus: Vec<_> = seg.collect();
        assert_eq!(fpdus.len(), 3);
        let mut joined: Vec<u8> = Vec::new();
        for (i, f) in fpdus.iter().enumerate() {
            let to = 0x1000 + 114 * i as u64;
            assert_eq!(f.header().kind, HeaderKind::Tagged { stag: 7, to });
            assert_eq!(f.header().last, i == 2);
            let len = if i == 2 { 300 - 228 } else { 114 };
            assert_eq!(f.payload_len(), len);
            assert_eq!(f.head()[..2], ((14 + len) as u16).to_be_bytes());
            assert_eq!(f.wire_len(), fpdu_len(14 + len));
            let mut bytes = Vec::new();
            f.append_to(&mut bytes);
            let crc_at = bytes.len() - 4;
            assert_eq!(crc32c(&bytes[..crc_at]).to_le_bytes(), bytes[crc_at..]);
            joined.extend(f.payload().flatten().copied());
            let mut v = Vec::new();
            f.io_slices(&mut v);
            assert_eq!(v.iter().map(|s| s.len()).sum::<usize>(), f.wire_len());
        }
        assert_eq!(joined, data);
        // The first segment spans both slices: 100 from the first, 14 from the second.
        let parts: Vec<usize> = fpdus[0].payload().map(|p| p.len()).collect();
        assert_eq!(parts, [100, 14]);
    }

    #[test]
    fn cuts_give_offsets_and_framing_matches_the_segmenter() {
        let cfg = TxConfig::new(true, 128).unwrap();
        let h = Header::untagged(Opcode::Send, 3, false);
        let cuts: Vec<_> = Cuts::new(h, 250, &cfg).collect();
        let at: Vec<_> = cuts.iter().map(|&(_, at, n)| (at, n)).collect();
        assert_eq!(at, [(0, 110), (110, 110), (220, 30)]);
        assert!(cuts[2].0.last && !cuts[0].0.last);
        let data = vec![5u8; 250];
        let sg = [&data[..]];
        for ((hdr, at, n), f) in cuts.into_iter().zip(segment(h, &sg, &cfg)) {
            let framing = Framing::new(&hdr, n, [&data[at..at + n]], true);
            assert_eq!((framing.head(), framing.trailer()), (f.head(), f.trailer()));
            assert_eq!(framing.overhead() + n, f.wire_len());
        }
        let mut empty = Cuts::new(h, 0, &cfg);
        assert_eq!(empty.count(), 1);
        assert_eq!(
            empty.next().map(|(h, at, n)| (h.last, at, n)),
            Some((true, 0, 0))
        );
        assert!(empty.next().is_none());
    }

    #[test]
    fn untagged_segments_carry_mo_and_one_msn() {
        let data = vec![7u8; 250];
        let sg = [&data[..]];
        let cfg = TxConfig::new(false, 128).unwrap(); // 110 payload bytes per untagged segment
        let fpdus: Vec<_> = segment(Header::untagged(Opcode::Send, 9, false), &sg, &cfg).collect();
        let mos: Vec<_> = fpdus
            .iter()
            .map(|f| match f.header().kind {
                HeaderKind::Untagged {
                    mo, msn: 9, qn: 0, ..
                } => mo,
                k => panic!("{k:?}"),
            })
            .collect();
        assert_eq!(mos, [0, 110, 220]);
        assert!(fpdus.iter().all(|f| f.trailer().ends_with(&[0, 0, 0, 0])));
    }

    #[test]
    fn empty_message_is_one_fpdu() {
        let sg: [&[u8]; 0] = [];
        let v: Vec<_> = segment(
            Header::tagged(Opcode::Write, 1, 0, false),
            &sg,
            &TxConfig::default(),
        )
        .collect();
        assert_eq!(v.len(), 1);
        assert!(v[0].header().last);
        assert_eq!(v[0].payload_len(), 0);
        assert_eq!(
            v[0].head(),
            &[0, 14, 0xC1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(v[0].trailer().len(), 4);
        let empties: [&[u8]; 2] = [b"", b""];
        assert_eq!(
            segment(
                Header::tagged(Opcode::Write, 1, 0, false),
                &empties,
                &TxConfig::default()
            )
            .count(),
            1
        );
    }

    #[test]
    fn config_limits() {
        assert!(matches!(
            TxConfig::new(true, 127),
            Err(WireError::InvalidConfig { .. })
        ));
        assert!(matches!(
            TxConfig::new(true, 65536),
            Err(WireError::InvalidConfig { .. })
        ));
        let c = TxConfig::new(false, 65535).unwrap();
        assert_eq!((c.crc(), c.max_ulpdu()), (false, 65535));
        assert_eq!(TxConfig::default().max_ulpdu(), 1454);
        let h = Header::untagged(Opcode::Send, 1, true);
        let mut out = Vec::new();
        assert!(matches!(
            encode_fpdu(&h, &vec![0; 65535 - 17], true, &mut out),
            Err(WireError::UlpduTooLong {
                ulpdu_len: 65536,
                ..
            })
        ));
        assert!(out.is_empty());
    }

    #[test]
    fn private_opcode_fpdus_match_protocol_md() {
        use super::super::rdmap::{
            AtomicWriteRequest, FlushPlacement, FlushRequest, FlushSelectivity, PrivateResponse,
        };
        let flush = FlushRequest {
            req_id: 0x0102_0304,
            placement: FlushPlacement::Persistent,
            selectivity: FlushSelectivity::Region { stag: 0x99 },
        };
        let aw = AtomicWriteRequest {
            req_id: 5,
            stag: 6,
            to: 8,
            data: [0xAB; 8],
        };
        let resp = PrivateResponse {
            req_id: 5,
            request: Opcode::AtomicWriteRequest,
        };
        type Case = (Opcode, u32, u32, Vec<u8>, usize, [u8; 4]);
        let cases: [Case; 3] = [
            (
                Opcode::FlushRequest,
                1,
                3,
                flush.encode().to_vec(),
                52,
                [0x00, 0x2e, 0x41, 0x4c],
            ),
            (
                Opcode::AtomicWriteRequest,
                1,
                4,
                aw.encode().to_vec(),
                48,
                [0x00, 0x2a, 0x41, 0x4d],
            ),
            (
                Opcode::PrivateResponse,
                3,
                2,
                resp.encode().to_vec(),
                32,
                [0x00, 0x1a, 0x41, 0x4e],
            ),
        ];
        for (op, qn, msn, body, len, start) in cases {
            let mut out = Vec::new();
            let n = encode_fpdu(&Header::untagged(op, msn, true), &body, true, &mut out).unwrap();
            assert_eq!(n, len, "{op:?}");
            assert_eq!(out[..4], start, "{op:?}");
            assert_eq!(out[4..8], [0; 4]);
            assert_eq!(out[8..12], qn.to_be_bytes(), "{op:?} QN");
            assert_eq!(out[12..16], msn.to_be_bytes());
            assert_eq!(out[16..20], [0; 4]);
            assert_eq!(&out[20..20 + body.len()], &body[..]);
            assert_eq!(20 + body.len() + 4, len, "{op:?} has no padding");
        }
    }
}
