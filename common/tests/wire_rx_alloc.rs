//! The receive path allocates nothing per FPDU: a counting global allocator sees no allocation
//! while a receiver takes in Writes (CRC on and off; gathered, read straight into place, into
//! memory asking for the cache write-back), Sends kept in its buffer and Read Requests, split
//! across reads. Only the receiver's creation (its ring) allocates.

use std::io::{self, Read};

use rpma_common::fabric::soft::placer::write_payload;
use rpma_common::fabric::soft::wire::ddp::{Header, HeaderKind, Opcode};
use rpma_common::fabric::soft::wire::rdmap::ReadRequest;
use rpma_common::fabric::soft::wire::rx::{
    Delivered, DirectTarget, FpduReceiver, Placement, Placer, RxConfig,
};
use rpma_common::fabric::soft::wire::terminate::TermCause;
use rpma_common::fabric::soft::wire::tx::{encode_fpdu, segment, TxConfig};
use rpma_common::fabric::soft::wire::{CapFlags, WireError};
use rpma_common::volatile::{ReadVolatile, VolatileSlice};

mod counting_alloc;

use counting_alloc::allocations;

/// Tagged segments of STag 1 go into `mem` (written back when `writeback`); the rest is kept in
/// the receiver's buffer.
struct Mem {
    base: *mut u8,
    len: usize,
    writeback: bool,
}

impl Placer for Mem {
    fn place(&mut self, h: &Header, len: usize) -> Result<Placement, TermCause> {
        match h.kind {
            HeaderKind::Tagged { stag: 1, to } if to as usize + len <= self.len => {
                // SAFETY: in bounds of the test's memory, which nothing else touches while the
                // receiver runs.
                let t = unsafe { DirectTarget::new(self.base.add(to as usize), len) };
                Ok(Placement::Direct(if self.writeback {
                    t.with_cache_writeback()
                } else {
                    t
                }))
            }
            HeaderKind::Tagged { .. } => Err(TermCause::DDP_TAGGED_BASE_BOUNDS),
            HeaderKind::Untagged { .. } => Ok(Placement::Buffer),
        }
    }

    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool, WireError> {
        write_payload(target, payload)
    }
}

/// The stream in reads of at most `chunk` bytes, a WouldBlock between reads, then WouldBlock.
struct Source<'a> {
    data: &'a [u8],
    pos: usize,
    chunk: usize,
    blocked: bool,
}

impl Source<'_> {
    fn next_len(&mut self, room: usize) -> io::Result<usize> {
        if self.pos == self.data.len() || !self.blocked {
            self.blocked = true;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.blocked = false;
        Ok(room.min(self.chunk).min(self.data.len() - self.pos))
    }
}

impl Read for Source<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.next_len(buf.len())?;
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl ReadVolatile for Source<'_> {
    fn read_volatile(&mut self, bufs: &[VolatileSlice<'_>]) -> io::Result<usize> {
        let Some(b) = bufs.iter().find(|b| !b.is_empty()) else {
            return Ok(0);
        };
        let n = self.next_len(b.len())?;
        b.write_at(0, &self.data[self.pos..self.pos + n])
            .expect("n <= b.len()");
        self.pos += n;
        Ok(n)
    }
}

/// Writes of `sizes` (each into its own range of `mem`), each followed by a Send and a Read
/// Request.
fn stream(crc: bool, sizes: &[usize]) -> (Vec<u8>, usize) {
    let tx = TxConfig::new(crc, 65535).unwrap();
    let mut out = Vec::new();
    let mut fpdus = 0;
    let mut to = 0u64;
    for (i, &n) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..n).map(|k| (k * 7 + i) as u8).collect();
        let sg = [&data[..]];
        for f in segment(Header::tagged(Opcode::Write, 1, to, true), &sg, &tx) {
            f.append_to(&mut out);
            fpdus += 1;
        }
        to += n as u64;
        let send = Header::untagged(Opcode::Send, i as u32 + 1, true);
        encode_fpdu(&send, &[i as u8; 40], crc, &mut out).unwrap();
        let rr = ReadRequest {
            sink_stag: 2,
            sink_to: 0,
            size: 8,
            src_stag: 1,
            src_to: 0,
        };
        let h = Header::untagged(Opcode::ReadRequest, i as u32 + 1, true);
        encode_fpdu(&h, &rr.encode(), crc, &mut out).unwrap();
        fpdus += 2;
    }
    (out, fpdus)
}

#[test]
fn receiving_allocates_nothing_per_fpdu() {
    // Small (gathered), 4 KiB, past read-ahead (read straight into place with CRC off), the
    // largest FPDU.
    let sizes = [100, 4096, 20_000, 65_000];
    let mut mem = vec![0u8; sizes.iter().sum::<usize>()];
    // The first pass warms up what is set up once (the CPU's cache write-back instruction).
    for (pass, crc, writeback) in (0..2).flat_map(|p| {
        [
            (p, true, false),
            (p, true, true),
            (p, false, false),
            (p, false, true),
        ]
    }) {
        let (data, fpdus) = stream(crc, &sizes);
        let cfg = RxConfig::new(crc, 65535, CapFlags::ALL).unwrap();
        let mut rx = FpduReceiver::new(cfg);
        let mut placer = Mem {
            base: mem.as_mut_ptr(),
            len: mem.len(),
            writeback,
        };
        let mut src = Source {
            data: &data,
            pos: 0,
            chunk: 3000,
            blocked: false,
        };
        let mut got = 0;
        let (made, ()) = allocations(|| {
            for _ in 0..100_000 {
                match rx.poll(&mut src, &mut placer) {
                    Ok(Some(r)) => {
                        got += 1;
                        assert!(!matches!(r.data, Delivered::Discarded));
                    }
                    Ok(None) => {}
                    Err(e) => panic!("crc {crc}: {e}"),
                }
                if src.pos == data.len() && rx.is_idle() {
                    break;
                }
            }
        });
        assert_eq!(got, fpdus, "crc {crc} writeback {writeback}");
        // The first pass warms (the receiver's ring reaches its size); the second is counted.
        assert!(
            pass == 0 || made == 0,
            "crc {crc} writeback {writeback}: the receive path allocated {made} times"
        );
    }
}
