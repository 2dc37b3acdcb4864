//! MPA connection set-up (RFC 5044 §7.1, revision 2 with the RFC 6581 IRD/ORD prefix):
//! frames, negotiation, and a blocking handshake over any `Read + Write`.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 16 | key `MPA ID Req Frame` / `MPA ID Rep Frame` |
//! | 16 | 1 | M 0x80, C 0x40, R 0x20, enhanced 0x10; rest zero |
//! | 17 | 1 | revision |
//! | 18 | 2 | private data length |
//! | 20 | 4 | RFC 6581 prefix (revision 2 + enhanced): P2P 0x8000, 0-len Send RTR 0x4000, IRD 0x3FFF; 0-len Write RTR 0x8000, 0-len Read RTR 0x4000, ORD 0x3FFF |
//! | 24 | n | application private data: our [`Caps`] block, then application bytes |
//!
//! Policy (docs/protocol.md): revision 2 with the IRD/ORD prefix is required (a revision-1 or
//! prefix-less peer is refused: without the prefix no Read limit can be agreed); markers are
//! refused; CRC is on when either side asks; IRD/ORD are the minimum of what both sides offer.

use std::io::{Read, Write};

use super::caps::{CapFlags, Caps};
pub use super::codes::MpaKind;
use super::cursor::Reader;
use super::error::{Result, WireError};

/// The Request key.
pub const REQ_KEY: &[u8; 16] = b"MPA ID Req Frame";
/// The Reply key.
pub const REP_KEY: &[u8; 16] = b"MPA ID Rep Frame";
/// Flag M: markers wanted.
pub const FLAG_MARKERS: u8 = 0x80;
/// Flag C: CRC wanted.
pub const FLAG_CRC: u8 = 0x40;
/// Flag R: reject (Reply only).
pub const FLAG_REJECT: u8 = 0x20;
/// RFC 6581 enhanced connection establishment: the IRD/ORD prefix is present.
pub const FLAG_ENHANCED: u8 = 0x10;
/// Length of the fixed part of a frame.
pub const FRAME_HDR_LEN: usize = 20;
/// The most private data accepted (RFC 5044).
pub const MAX_PRIVATE_DATA: usize = 512;
/// The most private data this implementation sends (Linux siw refuses more than 256).
pub const MAX_SENT_PRIVATE_DATA: usize = 256;
/// The largest IRD or ORD the prefix can carry.
pub const IRD_ORD_MAX: u16 = 0x3FFF;
/// The revision we speak.
pub const REVISION: u8 = 2;

/// The RFC 6581 IRD/ORD prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IrdOrd {
    /// Inbound RDMA Read (and Atomic, Flush, Atomic Write) requests this side accepts at once.
    pub ird: u16,
    /// Outbound such requests this side will have outstanding at once.
    pub ord: u16,
    /// Peer-to-peer mode: an RTR message precedes the first FPDU of the passive side.
    pub peer_to_peer: bool,
    /// A zero-length Send may serve as RTR.
    pub zero_len_send_rtr: bool,
    /// A zero-length RDMA Write may serve as RTR.
    pub zero_len_write_rtr: bool,
    /// A zero-length RDMA Read may serve as RTR.
    pub zero_len_read_rtr: bool,
}

impl IrdOrd {
    /// Encodes the 4-byte prefix (IRD and ORD are cut to 14 bits).
    pub fn encode(&self) -> [u8; 4] {
        let mut a = self.ird & IRD_ORD_MAX;
        if self.peer_to_peer {
            a |= 0x8000;
        }
        if self.zero_len_send_rtr {
            a |= 0x4000;
        }
        let mut b = self.ord & IRD_ORD_MAX;
        if self.zero_len_write_rtr {
            b |= 0x8000;
        }
        if self.zero_len_read_rtr {
            b |= 0x4000;
        }
        let [a0, a1] = a.to_be_bytes();
        let [b0, b1] = b.to_be_bytes();
        [a0, a1, b0, b1]
    }

    /// Decodes the 4-byte prefix.
    pub fn decode(p: [u8; 4]) -> IrdOrd {
        let a = u16::from_be_bytes([p[0], p[1]]);
        let b = u16::from_be_bytes([p[2], p[3]]);
        IrdOrd {
            ird: a & IRD_ORD_MAX,
            ord: b & IRD_ORD_MAX,
            peer_to_peer: a & 0x8000 != 0,
            zero_len_send_rtr: a & 0x4000 != 0,
            zero_len_write_rtr: b & 0x8000 != 0,
            zero_len_read_rtr: b & 0x4000 != 0,
        }
    }

    fn rtr_types(&self) -> RtrTypes {
        RtrTypes {
            send: self.zero_len_send_rtr,
            write: self.zero_len_write_rtr,
            read: self.zero_len_read_rtr,
        }
    }
}

/// An MPA Request or Reply frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpaFrame {
    /// Request or Reply (from the key).
    pub kind: MpaKind,
    /// M: markers wanted.
    pub markers: bool,
    /// C: CRC wanted.
    pub crc: bool,
    /// R: reject (Reply only).
    pub reject: bool,
    /// Revision, 1 or 2.
    pub revision: u8,
    /// The RFC 6581 enhanced flag as received. On encode the flag is set when this is true or
    /// `ird_ord` is present.
    pub enhanced: bool,
    /// The IRD/ORD prefix (revision 2 with the enhanced flag).
    pub ird_ord: Option<IrdOrd>,
    /// Private data after the prefix.
    pub private_data: Vec<u8>,
}

impl MpaFrame {
    /// Total private data length on the wire (prefix included).
    pub fn private_len(&self) -> usize {
        self.private_data.len() + if self.ird_ord.is_some() { 4 } else { 0 }
    }

    /// Encodes the frame.
    ///
    /// # Errors
    /// [`WireError::PrivateDataTooLong`] beyond 512 bytes of private data (prefix included).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let pd_len = self.private_len();
        if pd_len > MAX_PRIVATE_DATA {
            return Err(WireError::PrivateDataTooLong {
                len: pd_len,
                max: MAX_PRIVATE_DATA,
            });
        }
        let mut out = Vec::with_capacity(FRAME_HDR_LEN + pd_len);
        out.extend_from_slice(match self.kind {
            MpaKind::Request => REQ_KEY,
            MpaKind::Reply => REP_KEY,
        });
        let mut flags = 0;
        if self.markers {
            flags |= FLAG_MARKERS;
        }
        if self.crc {
            flags |= FLAG_CRC;
        }
        if self.reject {
            flags |= FLAG_REJECT;
        }
        if self.enhanced || self.ird_ord.is_some() {
            flags |= FLAG_ENHANCED;
        }
        out.push(flags);
        out.push(self.revision);
        out.extend_from_slice(&(pd_len as u16).to_be_bytes());
        if let Some(io) = &self.ird_ord {
            out.extend_from_slice(&io.encode());
        }
        out.extend_from_slice(&self.private_data);
        Ok(out)
    }

    /// Incremental decode: `Ok(None)` while `buf` holds less than a whole frame, else the frame
    /// and the bytes it used. Reserved flag bits are ignored; the revision is not judged here
    /// ([`negotiate`] does).
    ///
    /// # Errors
    /// [`WireError::BadMpaKey`] (checked as soon as 16 bytes are there),
    /// [`WireError::PrivateDataTooLong`] beyond 512 bytes, [`WireError::MissingIrdOrd`] if the
    /// enhanced flag is set on a revision-2 frame with less than 4 bytes of private data.
    pub fn decode(buf: &[u8]) -> Result<Option<(MpaFrame, usize)>> {
        if buf.len() < 16 {
            // A wrong key is reported as early as possible, even from a partial frame.
            if !(REQ_KEY.starts_with(buf) || REP_KEY.starts_with(buf)) {
                return Err(WireError::BadMpaKey { expected: None });
            }
            return Ok(None);
        }
        let kind = match &buf[..16] {
            k if k == REQ_KEY => MpaKind::Request,
            k if k == REP_KEY => MpaKind::Reply,
            _ => return Err(WireError::BadMpaKey { expected: None }),
        };
        if buf.len() < FRAME_HDR_LEN {
            return Ok(None);
        }
        let mut r = Reader::new(&buf[16..FRAME_HDR_LEN], "MPA frame");
        let flags = r.u8()?;
        let revision = r.u8()?;
        let pd_len = r.u16()? as usize;
        if pd_len > MAX_PRIVATE_DATA {
            return Err(WireError::PrivateDataTooLong {
                len: pd_len,
                max: MAX_PRIVATE_DATA,
            });
        }
        let total = FRAME_HDR_LEN + pd_len;
        if buf.len() < total {
            return Ok(None);
        }
        let pd = &buf[FRAME_HDR_LEN..total];
        let enhanced = flags & FLAG_ENHANCED != 0;
        let (ird_ord, private_data) = if enhanced && revision == 2 {
            if pd.len() < 4 {
                return Err(WireError::MissingIrdOrd);
            }
            (
                Some(IrdOrd::decode([pd[0], pd[1], pd[2], pd[3]])),
                pd[4..].to_vec(),
            )
        } else {
            (None, pd.to_vec())
        };
        let frame = MpaFrame {
            kind,
            markers: flags & FLAG_MARKERS != 0,
            crc: flags & FLAG_CRC != 0,
            reject: flags & FLAG_REJECT != 0,
            revision,
            enhanced,
            ird_ord,
            private_data,
        };
        Ok(Some((frame, total)))
    }
}

/// A set of RTR message types (RFC 6581 peer-to-peer mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RtrTypes {
    /// Zero-length Send.
    pub send: bool,
    /// Zero-length RDMA Write.
    pub write: bool,
    /// Zero-length RDMA Read.
    pub read: bool,
}

impl RtrTypes {
    /// All three.
    pub const ALL: RtrTypes = RtrTypes {
        send: true,
        write: true,
        read: true,
    };

    /// The preferred type in both sets: Write, then Read, then Send.
    fn choose(self, other: RtrTypes) -> Option<Rtr> {
        if self.write && other.write {
            Some(Rtr::Write)
        } else if self.read && other.read {
            Some(Rtr::Read)
        } else if self.send && other.send {
            Some(Rtr::Send)
        } else {
            None
        }
    }
}

/// The ready-to-receive message agreed for peer-to-peer mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rtr {
    /// Zero-length Send.
    Send,
    /// Zero-length RDMA Write.
    Write,
    /// Zero-length RDMA Read (answered by a zero-length Read Response).
    Read,
}

/// One side's MPA settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpaConfig {
    /// Ask for CRC (C flag). CRC is used when either side asks.
    pub crc: bool,
    /// Inbound Read/Atomic/Flush/Atomic Write requests we accept at once (<= 0x3FFF).
    pub ird: u16,
    /// Outbound such requests we want outstanding at once (<= 0x3FFF).
    pub ord: u16,
    /// Our capability block and application bytes (at most 252 bytes encoded).
    pub caps: Caps,
    /// Peer-to-peer mode. Active side: request it, offering these RTR types. Passive side: the
    /// RTR types we accept (None: all three).
    pub peer_to_peer: Option<RtrTypes>,
}

impl Default for MpaConfig {
    fn default() -> Self {
        MpaConfig {
            crc: true,
            ird: 16,
            ord: 16,
            caps: Caps::new(
                CapFlags::ALL,
                Some(super::DEFAULT_MAX_ULPDU as u16),
                Vec::new(),
            ),
            peer_to_peer: None,
        }
    }
}

impl MpaConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`WireError::InvalidConfig`] for IRD/ORD above 0x3FFF or private data above 256 bytes.
    pub fn validate(&self) -> Result<()> {
        if self.ird > IRD_ORD_MAX || self.ord > IRD_ORD_MAX {
            return Err(WireError::InvalidConfig {
                what: "IRD/ORD above 0x3FFF",
            });
        }
        if 4 + self.caps.len() > MAX_SENT_PRIVATE_DATA {
            return Err(WireError::InvalidConfig {
                what: "private data above 256 bytes",
            });
        }
        Ok(())
    }

    /// The Request frame for these settings.
    pub fn request(&self) -> MpaFrame {
        let rtr = self.peer_to_peer.unwrap_or_default();
        let mut pd = Vec::with_capacity(self.caps.len());
        self.caps.encode_into(&mut pd);
        MpaFrame {
            kind: MpaKind::Request,
            markers: false,
            crc: self.crc,
            reject: false,
            revision: REVISION,
            enhanced: true,
            ird_ord: Some(IrdOrd {
                ird: self.ird,
                ord: self.ord,
                peer_to_peer: self.peer_to_peer.is_some(),
                zero_len_send_rtr: rtr.send,
                zero_len_write_rtr: rtr.write,
                zero_len_read_rtr: rtr.read,
            }),
            private_data: pd,
        }
    }

    /// The accepting Reply for a negotiation outcome.
    pub fn reply(&self, n: &Negotiated) -> MpaFrame {
        let mut pd = Vec::with_capacity(self.caps.len());
        self.caps.encode_into(&mut pd);
        MpaFrame {
            kind: MpaKind::Reply,
            markers: false,
            crc: n.crc,
            reject: false,
            revision: REVISION,
            enhanced: true,
            ird_ord: Some(IrdOrd {
                ird: n.ird,
                ord: n.ord,
                peer_to_peer: n.rtr.is_some(),
                zero_len_send_rtr: n.rtr == Some(Rtr::Send),
                zero_len_write_rtr: n.rtr == Some(Rtr::Write),
                zero_len_read_rtr: n.rtr == Some(Rtr::Read),
            }),
            private_data: pd,
        }
    }
}

/// A rejecting Reply (R=1), answering a Request of revision `revision` in its own revision when
/// that is 1 or 2.
pub fn reject_reply(revision: u8) -> MpaFrame {
    let revision = if revision == 1 { 1 } else { REVISION };
    MpaFrame {
        kind: MpaKind::Reply,
        markers: false,
        crc: false,
        reject: true,
        revision,
        enhanced: revision == 2,
        ird_ord: (revision == 2).then_some(IrdOrd::default()),
        private_data: Vec::new(),
    }
}

/// The outcome of MPA negotiation, identical on both sides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Whether FPDUs carry a checked CRC32c.
    pub crc: bool,
    /// Inbound requests (Read, Atomic, Flush, Atomic Write) we must accept at once; one more is
    /// a Terminate.
    pub ird: u16,
    /// Outbound such requests we may have outstanding at once.
    pub ord: u16,
    /// The peer's capabilities and application bytes.
    pub caps: Caps,
    /// Capabilities both sides have: the private opcodes may be used only if set here.
    pub shared: CapFlags,
    /// Peer-to-peer RTR. Active side: send this zero-length message before anything else.
    /// Passive side: the first message received is this RTR; consume it, send nothing before.
    pub rtr: Option<Rtr>,
}

impl Negotiated {
    /// The largest ULPDU to send: `local_max` cut to what the peer stated it accepts.
    pub fn tx_max_ulpdu(&self, local_max: usize) -> usize {
        match self.caps.max_ulpdu {
            Some(m) => local_max.min(m as usize),
            None => local_max.min(super::DEFAULT_MAX_ULPDU),
        }
    }
}

/// Negotiates from our settings and the peer's frame (its Request when we are passive, its
/// Reply when we are active).
///
/// # Errors
/// [`WireError::MarkersRequested`], [`WireError::Rejected`] (a Reply with R=1),
/// [`WireError::BadMpaRevision`] for anything but revision 2, [`WireError::MissingIrdOrd`],
/// [`WireError::BadCaps`], [`WireError::NoMatchingRtr`], [`WireError::InvalidConfig`].
pub fn negotiate(local: &MpaConfig, peer: &MpaFrame) -> Result<Negotiated> {
    local.validate()?;
    if peer.kind == MpaKind::Reply && peer.reject {
        return Err(WireError::Rejected);
    }
    if peer.markers {
        return Err(WireError::MarkersRequested);
    }
    if peer.revision != REVISION {
        return Err(WireError::BadMpaRevision {
            revision: peer.revision,
        });
    }
    let io = peer.ird_ord.ok_or(WireError::MissingIrdOrd)?;
    let caps = Caps::decode(&peer.private_data)?;
    let rtr = match peer.kind {
        MpaKind::Request if io.peer_to_peer => {
            let ours = local.peer_to_peer.unwrap_or(RtrTypes::ALL);
            Some(
                ours.choose(io.rtr_types())
                    .ok_or(WireError::NoMatchingRtr)?,
            )
        }
        MpaKind::Reply if io.peer_to_peer => match local.peer_to_peer {
            Some(offered) => Some(
                offered
                    .choose(io.rtr_types())
                    .ok_or(WireError::NoMatchingRtr)?,
            ),
            // The passive side turned on peer-to-peer although we did not ask.
            None => return Err(WireError::NoMatchingRtr),
        },
        _ => None,
    };
    Ok(Negotiated {
        crc: local.crc || peer.crc,
        ird: local.ird.min(io.ord),
        ord: local.ord.min(io.ird),
        shared: local.caps.flags.intersection(caps.flags),
        caps,
        rtr,
    })
}

/// An MPA frame as read from the stream, before it is judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFrame {
    /// The 20-byte header and the private data (left out if longer than
    /// [`MAX_PRIVATE_DATA`]).
    pub bytes: Vec<u8>,
    /// The revision the header states (to answer a refusal in kind).
    pub revision: u8,
    /// The private-data length the header states.
    pub pd_len: usize,
}

impl RawFrame {
    /// Whether the private data is longer than [`MAX_PRIVATE_DATA`] (and was not kept).
    pub fn oversize(&self) -> bool {
        self.pd_len > MAX_PRIVATE_DATA
    }
}

/// Reads one MPA frame's header and private data from a blocking stream. Oversize private
/// data is read and dropped (at most 64 KiB), so that closing after a reject does not reset
/// the connection and lose the reject on its way.
///
/// # Errors
/// [`WireError::Io`] (or [`WireError::Closed`]) while reading, naming `what`.
pub fn read_raw_frame<S: Read>(stream: &mut S, what: &'static str) -> Result<RawFrame> {
    let mut hdr = [0u8; FRAME_HDR_LEN];
    stream
        .read_exact(&mut hdr)
        .map_err(|e| WireError::io(what, e))?;
    let pd_len = u16::from_be_bytes([hdr[18], hdr[19]]) as usize;
    let mut bytes = hdr.to_vec();
    if pd_len <= MAX_PRIVATE_DATA {
        bytes.resize(FRAME_HDR_LEN + pd_len, 0);
        stream
            .read_exact(&mut bytes[FRAME_HDR_LEN..])
            .map_err(|e| WireError::io(what, e))?;
    } else {
        let mut rest = (&mut *stream).take(pd_len as u64);
        std::io::copy(&mut rest, &mut std::io::sink()).map_err(|e| WireError::io(what, e))?;
    }
    Ok(RawFrame {
        bytes,
        revision: hdr[17],
        pd_len,
    })
}

fn read_frame<S: Read>(stream: &mut S, expected: MpaKind) -> Result<MpaFrame> {
    let raw = read_raw_frame(stream, "MPA frame read")?;
    let (buf, pd_len) = (raw.bytes, raw.pd_len);
    let (frame, _) = MpaFrame::decode(&buf)?.ok_or(WireError::Truncated {
        what: "MPA frame",
        need: FRAME_HDR_LEN + pd_len,
        have: buf.len(),
    })?;
    if frame.kind != expected {
        return Err(WireError::BadMpaKey {
            expected: Some(expected),
        });
    }
    Ok(frame)
}

fn write_frame<S: Write>(stream: &mut S, frame: &MpaFrame) -> Result<()> {
    let bytes = frame.encode()?;
    stream
        .write_all(&bytes)
        .map_err(|e| WireError::io("MPA frame write", e))?;
    stream
        .flush()
        .map_err(|e| WireError::io("MPA frame write", e))
}

/// The active side's handshake: sends the Request, reads and judges the Reply. The stream must
/// be blocking (set a read timeout on it to bound the wait). On success the first FPDU is ours
/// to send (RFC 5044), preceded by the RTR if [`Negotiated::rtr`] is set.
///
/// # Errors
/// I/O ([`WireError::Io`], [`WireError::Closed`]), a malformed Reply ([`WireError::BadMpaKey`],
/// [`WireError::PrivateDataTooLong`], ...), and those of [`negotiate`], notably
/// [`WireError::Rejected`].
pub fn connect_handshake<S: Read + Write>(stream: &mut S, cfg: &MpaConfig) -> Result<Negotiated> {
    match connect_exchange(stream, cfg)? {
        Answer::Accepted(n) => Ok(n),
        Answer::Rejected { .. } => Err(WireError::Rejected),
    }
}

/// How the passive side answered an MPA Request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Accepted; what was agreed.
    Accepted(Negotiated),
    /// Refused (a Reply with R=1), with the private data the peer sent along (after the
    /// IRD/ORD prefix, if any; no capability block).
    Rejected {
        /// The peer's private data.
        private_data: Vec<u8>,
    },
}

/// As [`connect_handshake`], but a rejecting Reply is an [`Answer::Rejected`] carrying the
/// peer's private data (rdma_cm hands it to the application with `RDMA_CM_EVENT_REJECTED`).
///
/// # Errors
/// As [`connect_handshake`], except [`WireError::Rejected`].
pub fn connect_exchange<S: Read + Write>(stream: &mut S, cfg: &MpaConfig) -> Result<Answer> {
    cfg.validate()?;
    write_frame(stream, &cfg.request())?;
    let reply = read_frame(stream, MpaKind::Reply)?;
    if reply.reject {
        return Ok(Answer::Rejected {
            private_data: reply.private_data,
        });
    }
    negotiate(cfg, &reply).map(Answer::Accepted)
}

/// The passive side's handshake: reads the Request, answers with a Reply. A Request we refuse
/// (markers, a wrong key or revision, oversize private data, no IRD/ORD prefix, a bad capability
/// block, no matching RTR) gets a Reply with R=1 and the error is returned; the caller then
/// closes the connection.
///
/// # Errors
/// As [`connect_handshake`], except [`WireError::Rejected`].
pub fn accept_handshake<S: Read + Write>(stream: &mut S, cfg: &MpaConfig) -> Result<Negotiated> {
    cfg.validate()?;
    let raw = read_raw_frame(stream, "MPA Request read")?;
    let (buf, revision) = (raw.bytes, raw.revision);
    let outcome = (|| {
        if buf[..16] != REQ_KEY[..] {
            return Err(WireError::BadMpaKey {
                expected: Some(MpaKind::Request),
            });
        }
        let (req, _) = MpaFrame::decode(&buf)?.ok_or(WireError::MissingIrdOrd)?;
        negotiate(cfg, &req)
    })();
    match outcome {
        Ok(n) => {
            write_frame(stream, &cfg.reply(&n))?;
            Ok(n)
        }
        Err(e @ (WireError::Io { .. } | WireError::Closed { .. })) => Err(e),
        Err(e) => {
            // Best effort: the peer learns it was refused; the error that matters is `e`.
            let _ = write_frame(stream, &reject_reply(revision));
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests;
