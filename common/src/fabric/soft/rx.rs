//! The receive side of a connection: FPDUs cut out of a non-blocking TCP stream that splits
//! and packs them arbitrarily, checked, and their payloads placed where a [`Placer`] says.
//!
//! Two paths, both placing nothing before the checks:
//! - staged: the whole FPDU is in the read-ahead buffer; its CRC (when negotiated) is checked,
//!   then the placer checks STag, bounds and rights, then the payload is copied into place.
//!   With CRC on this is the only path: integrity before placement needs the whole FPDU.
//! - direct (CRC off, a data FPDU not yet fully buffered): the header is decoded, the placer
//!   checks it, and the rest of the payload is read from the socket straight into the
//!   registered memory, with no staging copy.
//!
//! Written against the wire layer's header and body codecs; see the report on the `wire`
//! branch's own receiver.

use std::io::{self, Read};

use crate::fabric::soft::wire::rdmap::Body;
use crate::fabric::soft::wire::{self, Header, WireError};

/// The largest ULPDU the 16-bit MPA length can carry.
pub(crate) const MAX_ULPDU: usize = u16::MAX as usize;
const BUF: usize = 2 * (2 + MAX_ULPDU + 3 + 4);

/// Where an FPDU's payload goes.
pub(crate) enum Placement {
    /// Into memory at this address, which the placer checked for the payload's length.
    Direct(*mut u8),
    /// Nowhere.
    Discard,
}

/// Decides placement for each data FPDU (Write, Read Response, Sends).
pub(crate) trait Placer {
    /// Called once per data FPDU, after its CRC passed (staged path) and before any payload
    /// byte is placed.
    fn place(&mut self, hdr: &Header, len: usize) -> Placement;
}

/// A completed FPDU.
#[derive(Debug)]
pub(crate) enum Event {
    /// A data FPDU whose `len` payload bytes have been placed (or discarded).
    Data { hdr: Header, len: usize },
    /// A control message.
    Control {
        hdr: Header,
        body: Body,
        ulpdu_len: usize,
    },
}

#[derive(Debug)]
pub(crate) enum RxError {
    /// The peer closed the stream.
    Closed,
    /// The stream failed.
    Io(io::Error),
    /// A malformed FPDU: answer with `err.terminate_cause()`.
    Wire {
        err: WireError,
        hdr: Option<Header>,
        ulpdu_len: usize,
    },
}

struct Direct {
    hdr: Header,
    ulpdu_len: usize,
    payload_len: usize,
    dst: Option<*mut u8>,
    done: usize,
}

pub(crate) struct Rx {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    crc: bool,
    max_ulpdu: usize,
    direct: Option<Direct>,
}

// SAFETY: the raw destination pointer in `direct` was handed out by the placer for memory the
// engine keeps alive; Rx is only used under the queue pair's lock.
unsafe impl Send for Rx {}

impl Rx {
    pub(crate) fn new(crc: bool, max_ulpdu: usize) -> Rx {
        Rx {
            buf: vec![0u8; BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            crc,
            max_ulpdu: max_ulpdu.min(MAX_ULPDU),
            direct: None,
        }
    }

    fn fill<R: Read>(&mut self, src: &mut R) -> Result<bool, RxError> {
        if self.start > 0 && (self.start == self.end || self.end > BUF / 2) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match src.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(RxError::Closed),
                Ok(n) => {
                    self.end += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RxError::Io(e)),
            }
        }
    }

    /// Returns the next completed FPDU, or None when the stream has nothing more for now.
    pub(crate) fn poll<R: Read, P: Placer>(
        &mut self,
        src: &mut R,
        placer: &mut P,
    ) -> Result<Option<Event>, RxError> {
        loop {
            if self.direct.is_some() {
                match self.continue_direct(src)? {
                    Some(ev) => return Ok(Some(ev)),
                    None => return Ok(None),
                }
            }
            if let Some(ev) = self.try_parse(placer)? {
                return Ok(Some(ev));
            }
            if self.direct.is_some() {
                continue;
            }
            if !self.fill(src)? {
                return Ok(None);
            }
        }
    }

    /// Parses from the buffer: a whole FPDU (staged), or a header that starts a direct FPDU.
    fn try_parse<P: Placer>(&mut self, placer: &mut P) -> Result<Option<Event>, RxError> {
        let avail = &self.buf[self.start..self.end];
        if avail.len() < 2 {
            return Ok(None);
        }
        let ulpdu_len = u16::from_be_bytes([avail[0], avail[1]]) as usize;
        let werr = |err, hdr| RxError::Wire {
            err,
            hdr,
            ulpdu_len,
        };
        if ulpdu_len > self.max_ulpdu {
            return Err(werr(
                WireError::UlpduTooLong {
                    ulpdu_len,
                    max: self.max_ulpdu,
                },
                None,
            ));
        }
        let pad = wire::pad_len(ulpdu_len);
        let total = 2 + ulpdu_len + pad + 4;
        if avail.len() < total {
            // Not all here: go direct if allowed and worth it, else wait for more.
            if self.crc {
                return Ok(None);
            }
            let Some(hlen) = Header::peek_len(&avail[2..]) else {
                return Ok(None);
            };
            if avail.len() < 2 + hlen || ulpdu_len < hlen {
                return Ok(None);
            }
            let (hdr, hlen) = Header::decode(&avail[2..2 + ulpdu_len.min(avail.len() - 2)])
                .map_err(|e| werr(e, None))?;
            if !hdr.opcode.carries_data() {
                return Ok(None);
            }
            let payload_len = ulpdu_len - hlen;
            let dst = match placer.place(&hdr, payload_len) {
                Placement::Direct(p) => Some(p),
                Placement::Discard => None,
            };
            let have = (avail.len() - 2 - hlen).min(payload_len);
            if let Some(p) = dst {
                // SAFETY: the placer checked `payload_len` bytes at `p`, and `have` is at most
                // that.
                unsafe {
                    std::ptr::copy_nonoverlapping(avail[2 + hlen..].as_ptr(), p, have);
                }
            }
            self.start += 2 + hlen + have;
            self.direct = Some(Direct {
                hdr,
                ulpdu_len,
                payload_len,
                dst,
                done: have,
            });
            return Ok(None);
        }
        let fpdu = &avail[..total];
        if self.crc {
            let got = u32::from_le_bytes(fpdu[total - 4..].try_into().expect("4 bytes"));
            let computed = wire::crc32c(&fpdu[..total - 4]);
            if got != computed {
                return Err(werr(
                    WireError::BadCrc {
                        computed,
                        received: got,
                    },
                    None,
                ));
            }
        }
        let ulpdu = &fpdu[2..2 + ulpdu_len];
        let (hdr, hlen) = Header::decode(ulpdu).map_err(|e| werr(e, None))?;
        let payload = &ulpdu[hlen..];
        let ev = if hdr.opcode.carries_data() {
            if let Placement::Direct(p) = placer.place(&hdr, payload.len()) {
                // SAFETY: the placer checked `payload.len()` bytes at `p` (STag, bounds,
                // rights) and keeps the memory alive; the buffer is ours, so no overlap.
                unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), p, payload.len()) };
            }
            Event::Data {
                hdr,
                len: payload.len(),
            }
        } else {
            let body = Body::decode(hdr.opcode, payload).map_err(|e| werr(e, Some(hdr)))?;
            let body = body.ok_or_else(|| {
                werr(
                    WireError::UnexpectedOpcode {
                        opcode: hdr.opcode,
                        reason: "no body",
                    },
                    Some(hdr),
                )
            })?;
            Event::Control {
                hdr,
                body,
                ulpdu_len,
            }
        };
        self.start += total;
        Ok(Some(ev))
    }

    fn continue_direct<R: Read>(&mut self, src: &mut R) -> Result<Option<Event>, RxError> {
        let d = self.direct.as_mut().expect("direct in progress");
        while d.done < d.payload_len {
            let want = d.payload_len - d.done;
            let r = match d.dst {
                Some(p) => {
                    // SAFETY: the placer checked `payload_len` bytes at `p`; we write only the
                    // `want` bytes not yet received, straight from the socket.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.add(d.done), want) };
                    src.read(dst)
                }
                None => {
                    // The buffer is empty here (the payload is not all in), so reuse it.
                    self.start = 0;
                    self.end = 0;
                    let n = want.min(self.buf.len());
                    src.read(&mut self.buf[..n])
                }
            };
            match r {
                Ok(0) => return Err(RxError::Closed),
                Ok(n) => d.done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RxError::Io(e)),
            }
        }
        // Payload in place; the trailer (pad + unchecked CRC) follows in the buffer.
        let trailer = wire::pad_len(d.ulpdu_len) + 4;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        while self.end - self.start < trailer {
            if !self.fill(src)? {
                return Ok(None);
            }
        }
        self.start += trailer;
        let d = self.direct.take().expect("direct in progress");
        Ok(Some(Event::Data {
            hdr: d.hdr,
            len: d.payload_len,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::soft::wire::Opcode;
    use std::collections::VecDeque;

    /// A reader that hands out the stream in given chunk sizes, then WouldBlock.
    struct Chunks {
        data: Vec<u8>,
        pos: usize,
        sizes: VecDeque<usize>,
    }

    impl Read for Chunks {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.pos == self.data.len() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = self.sizes.pop_front().unwrap_or(usize::MAX).min(buf.len());
            let n = n.min(self.data.len() - self.pos).max(1);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    struct Sink {
        mem: Vec<u8>,
    }

    impl Placer for Sink {
        fn place(&mut self, hdr: &Header, len: usize) -> Placement {
            match hdr.kind {
                wire::HeaderKind::Tagged { to, .. } if to as usize + len <= self.mem.len() => {
                    Placement::Direct(self.mem.as_mut_ptr().wrapping_add(to as usize))
                }
                _ => Placement::Discard,
            }
        }
    }

    fn fpdu(hdr: Header, payload: &[u8], crc: bool) -> Vec<u8> {
        let mut v = Vec::new();
        let h = hdr.encode();
        let ulpdu = h.as_slice().len() + payload.len();
        v.extend_from_slice(&(ulpdu as u16).to_be_bytes());
        v.extend_from_slice(h.as_slice());
        v.extend_from_slice(payload);
        v.resize(v.len() + wire::pad_len(ulpdu), 0);
        let c = if crc { wire::crc32c(&v) } else { 0 };
        v.extend_from_slice(&c.to_le_bytes());
        v
    }

    fn stream(crc: bool) -> (Vec<u8>, Vec<u8>) {
        let mut s = Vec::new();
        let mut want = vec![0u8; 300_000];
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut to = 0usize;
        for chunk in data.chunks(60_000) {
            s.extend(fpdu(
                Header::tagged(Opcode::Write, 1, to as u64, false),
                chunk,
                crc,
            ));
            want[to..to + chunk.len()].copy_from_slice(chunk);
            to += chunk.len();
        }
        for (i, chunk) in data[..999].chunks(37).enumerate() {
            let to = 250_000 + i * 37;
            s.extend(fpdu(
                Header::tagged(Opcode::Write, 1, to as u64, false),
                chunk,
                crc,
            ));
            want[to..to + chunk.len()].copy_from_slice(chunk);
        }
        (s, want)
    }

    fn run(crc: bool, sizes: Vec<usize>) {
        let (data, want) = stream(crc);
        let mut src = Chunks {
            data,
            pos: 0,
            sizes: sizes.into(),
        };
        let mut rx = Rx::new(crc, MAX_ULPDU);
        let mut sink = Sink {
            mem: vec![0u8; 300_000],
        };
        let mut events = 0;
        for _ in 0..1_000_000 {
            match rx.poll(&mut src, &mut sink) {
                Ok(Some(Event::Data { .. })) => events += 1,
                Ok(Some(ev)) => panic!("unexpected {ev:?}"),
                Ok(None)
                    if src.pos == src.data.len() && rx.direct.is_none() && rx.start == rx.end =>
                {
                    break
                }
                Ok(None) => {}
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(events, 4 + 27);
        assert!(sink.mem == want, "placed bytes differ");
    }

    #[test]
    fn reassembles_across_any_split_with_and_without_crc() {
        for crc in [false, true] {
            run(crc, vec![]);
            run(crc, vec![1; 5000]);
            run(crc, (0..5000).map(|i| (i * 7919) % 3001 + 1).collect());
        }
    }

    #[test]
    fn bad_crc_is_refused_before_placement() {
        let mut data = fpdu(Header::tagged(Opcode::Write, 1, 0, true), &[9u8; 64], true);
        data[30] ^= 1;
        let mut src = Chunks {
            data,
            pos: 0,
            sizes: VecDeque::new(),
        };
        let mut rx = Rx::new(true, MAX_ULPDU);
        let mut sink = Sink {
            mem: vec![0u8; 128],
        };
        let err = rx.poll(&mut src, &mut sink).unwrap_err();
        match err {
            RxError::Wire { err, .. } => {
                assert_eq!(err.terminate_cause(), wire::TermCause::MPA_CRC)
            }
            e => panic!("{e:?}"),
        }
        assert!(sink.mem.iter().all(|&b| b == 0), "nothing placed");
    }

    #[test]
    fn malformed_header_and_eof() {
        let mut data = fpdu(Header::tagged(Opcode::Write, 1, 0, true), &[1u8; 8], false);
        data[2] = 0x80 | 0x40 | 0x02; // DDP version 2
        let mut src = Chunks {
            data,
            pos: 0,
            sizes: VecDeque::new(),
        };
        let mut rx = Rx::new(false, MAX_ULPDU);
        let mut sink = Sink { mem: vec![0u8; 16] };
        assert!(matches!(
            rx.poll(&mut src, &mut sink),
            Err(RxError::Wire { .. })
        ));
        struct Eof;
        impl Read for Eof {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Ok(0)
            }
        }
        let mut rx = Rx::new(false, MAX_ULPDU);
        assert!(matches!(rx.poll(&mut Eof, &mut sink), Err(RxError::Closed)));
    }
}
