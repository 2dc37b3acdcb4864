//! The crash harness's self-describing blocks and the ledger that judges them after a restart.
//!
//! A block (4096 bytes) holds a magic, its block number, its generation, the writer's id and a
//! checksum (FNV-1a 64) over everything else, including a body derived from the block number
//! and generation: a block made of pieces of two writes, or of a write and old bytes, fails the
//! checksum (torn). All zeros is a block never written.

/// Bytes per block: the namespaces' block size, and NBD's.
pub const BLOCK: usize = 4096;

const MAGIC: &[u8; 8] = b"RPMACRSH";
const SUM_AT: usize = 32;

/// What a block read back holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// All zeros: never written (or never persisted).
    Empty,
    /// A whole write: its block number, generation and writer.
    Valid {
        /// The block number it was written for.
        block: u64,
        /// Its generation.
        gen: u64,
        /// The writer's id.
        writer: u32,
    },
    /// Anything else: pieces of different writes, or of a write and older bytes.
    Torn,
}

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The block `block` of generation `gen` by `writer`.
pub fn encode(block: u64, gen: u64, writer: u32) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&block.to_le_bytes());
    b[16..24].copy_from_slice(&gen.to_le_bytes());
    b[24..28].copy_from_slice(&writer.to_le_bytes());
    let body = crate::noise(block.wrapping_mul(0x1_0000_0001) ^ gen, BLOCK - SUM_AT - 8);
    b[SUM_AT + 8..].copy_from_slice(&body);
    let sum = fnv(&[&b[..SUM_AT], &b[SUM_AT + 8..]]);
    b[SUM_AT..SUM_AT + 8].copy_from_slice(&sum.to_le_bytes());
    b
}

/// What `b` (one block) holds.
pub fn decode(b: &[u8]) -> Content {
    if b.iter().all(|&x| x == 0) {
        return Content::Empty;
    }
    if b.len() != BLOCK || &b[..8] != MAGIC {
        return Content::Torn;
    }
    let sum = u64::from_le_bytes(b[SUM_AT..SUM_AT + 8].try_into().unwrap());
    if sum != fnv(&[&b[..SUM_AT], &b[SUM_AT + 8..]]) {
        return Content::Torn;
    }
    let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap());
    Content::Valid {
        block: u(8..16),
        gen: u(16..24),
        writer: u32::from_le_bytes(b[24..28].try_into().unwrap()),
    }
}

/// What the harness knows of one block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    /// The newest generation acknowledged durable since the last check settled it (0: no
    /// claim: never acknowledged, or torn by an unacknowledged write).
    pub acked: u64,
    /// The newest generation issued (acknowledged or not).
    pub issued: u64,
    /// `issued` when it was last checked.
    checked: u64,
    /// It was torn at the last check.
    torn: bool,
}

/// The verdict on one block after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It holds its acknowledged generation or a later one (or nothing was promised).
    Ok,
    /// Torn by a write that was never acknowledged: allowed, counted.
    TornUnacknowledged,
    /// An acknowledged generation is gone: older content, zeros, or torn with no later write.
    Lost,
    /// Content no write of this block could have left: another block's, a generation never
    /// issued, or garbage where nothing was written.
    Corrupt,
}

/// Counts of one check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Tally {
    /// Blocks that carried an acknowledged generation when checked.
    pub acknowledged_checked: u64,
    /// See [`Verdict::Lost`].
    pub lost: u64,
    /// See [`Verdict::TornUnacknowledged`].
    pub torn_unacknowledged: u64,
    /// See [`Verdict::Corrupt`].
    pub corrupt: u64,
}

impl Tally {
    /// Adds another tally.
    pub fn add(&mut self, o: &Tally) {
        self.acknowledged_checked += o.acknowledged_checked;
        self.lost += o.lost;
        self.torn_unacknowledged += o.torn_unacknowledged;
        self.corrupt += o.corrupt;
    }
}

/// Every block of one namespace.
#[derive(Debug, Clone)]
pub struct Ledger {
    /// By block number.
    pub blocks: Vec<Entry>,
}

impl Ledger {
    /// `n` blocks, none written.
    pub fn new(n: usize) -> Ledger {
        Ledger {
            blocks: vec![Entry::default(); n],
        }
    }

    /// The generation to write next into `block`, recorded as issued.
    pub fn issue(&mut self, block: usize) -> u64 {
        let e = &mut self.blocks[block];
        e.issued += 1;
        e.issued
    }

    /// `gen` of `block` was acknowledged durable.
    pub fn ack(&mut self, block: usize, gen: u64) {
        let e = &mut self.blocks[block];
        e.acked = e.acked.max(gen);
    }

    /// Judges `content`, read back from `block` after a restart, and settles the entry to what
    /// the media now holds (the next cycle starts from there).
    pub fn check(&mut self, block: usize, content: Content) -> Verdict {
        let e = &mut self.blocks[block];
        let fresh = e.issued != e.checked;
        let verdict = match content {
            Content::Empty if e.acked == 0 => Verdict::Ok,
            Content::Empty => Verdict::Lost,
            Content::Valid { block: b, gen, .. } if b != block as u64 || gen > e.issued => {
                Verdict::Corrupt
            }
            Content::Valid { gen, .. } if gen < e.acked => Verdict::Lost,
            Content::Valid { .. } => Verdict::Ok,
            // Still the same torn block, nothing written into it since: counted already.
            Content::Torn if e.torn && !fresh => Verdict::Ok,
            Content::Torn if e.issued > e.acked => Verdict::TornUnacknowledged,
            Content::Torn if e.issued == 0 => Verdict::Corrupt,
            Content::Torn => Verdict::Lost,
        };
        match content {
            Content::Valid { gen, .. } if verdict == Verdict::Ok => {
                (e.acked, e.torn) = (gen, false);
            }
            Content::Empty => (e.acked, e.torn) = (0, false),
            Content::Torn => (e.acked, e.torn) = (0, true),
            // Lost or corrupt: the run fails; what follows is judged from the new content.
            Content::Valid { gen, .. } => (e.acked, e.torn) = (gen.min(e.issued), false),
        }
        e.checked = e.issued;
        verdict
    }

    /// Judges a whole namespace read back (`data`: every block in order) into a tally, and
    /// the blocks lost or corrupt, for the report.
    pub fn check_all(&mut self, data: &[u8]) -> (Tally, Vec<(usize, Verdict, Content)>) {
        let mut t = Tally::default();
        let mut bad = Vec::new();
        for (i, b) in data.chunks(BLOCK).enumerate().take(self.blocks.len()) {
            if self.blocks[i].acked > 0 {
                t.acknowledged_checked += 1;
            }
            let content = decode(b);
            match self.check(i, content) {
                Verdict::Ok => {}
                Verdict::TornUnacknowledged => t.torn_unacknowledged += 1,
                v @ Verdict::Lost => {
                    t.lost += 1;
                    bad.push((i, v, content));
                }
                v @ Verdict::Corrupt => {
                    t.corrupt += 1;
                    bad.push((i, v, content));
                }
            }
        }
        (t, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_describe_themselves_and_any_tear_shows() {
        let b = encode(7, 3, 2);
        assert_eq!(
            decode(&b),
            Content::Valid {
                block: 7,
                gen: 3,
                writer: 2
            }
        );
        assert_eq!(decode(&[0; BLOCK]), Content::Empty);
        let newer = encode(7, 4, 2);
        // A write that reached the media only in part, at every 64-byte line and byte.
        // (The first 16 bytes are the same in both: the generation differs from byte 16 on.)
        for cut in (64..BLOCK).step_by(64).chain([17, 23, 4095]) {
            let mut torn = newer[..cut].to_vec();
            torn.extend_from_slice(&b[cut..]);
            assert_eq!(decode(&torn), Content::Torn, "cut at {cut}");
            let mut half = newer[..cut].to_vec();
            half.resize(BLOCK, 0);
            assert_eq!(decode(&half), Content::Torn, "cut at {cut}, zeros after");
        }
    }

    #[test]
    fn the_ledger_passes_acknowledged_or_later_and_fails_anything_older() {
        let mut l = Ledger::new(4);
        let g1 = l.issue(0);
        l.ack(0, g1);
        let g2 = l.issue(0); // in flight at the kill
        assert_eq!((g1, g2), (1, 2));
        let v = |b, g| Content::Valid {
            block: b,
            gen: g,
            writer: 0,
        };
        // The acknowledged generation, or the later unacknowledged one: both fine.
        for (content, want) in [
            (v(0, 1), Verdict::Ok),
            (v(0, 2), Verdict::Ok),
            (Content::Torn, Verdict::TornUnacknowledged),
            (Content::Empty, Verdict::Lost),
            (v(0, 3), Verdict::Corrupt),
            (v(1, 1), Verdict::Corrupt),
        ] {
            let mut l = l.clone();
            assert_eq!(l.check(0, content), want, "{content:?}");
        }
        // Acknowledged and nothing after it: a tear is a loss.
        let mut l = Ledger::new(1);
        let g = l.issue(0);
        l.ack(0, g);
        assert_eq!(l.clone().check(0, Content::Torn), Verdict::Lost);
        assert_eq!(l.clone().check(0, Content::Empty), Verdict::Lost);
        let g2 = l.issue(0);
        l.ack(0, g2);
        assert_eq!(l.clone().check(0, v(0, 1)), Verdict::Lost, "older");
        // Never written: only zeros are right.
        let mut l = Ledger::new(1);
        assert_eq!(l.clone().check(0, Content::Torn), Verdict::Corrupt);
        assert_eq!(l.check(0, Content::Empty), Verdict::Ok);
    }

    #[test]
    fn a_check_settles_the_entry_for_the_next_cycle() {
        let mut l = Ledger::new(1);
        let g = l.issue(0);
        l.ack(0, g);
        l.issue(0);
        // The unacknowledged generation 2 landed whole: it is the claim from now on.
        let two = Content::Valid {
            block: 0,
            gen: 2,
            writer: 0,
        };
        assert_eq!(l.check(0, two), Verdict::Ok);
        assert_eq!(l.blocks[0].acked, 2);
        assert_eq!(l.clone().check(0, Content::Empty), Verdict::Lost);
        // Torn by an unacknowledged write: counted once, not again while nothing changes.
        l.issue(0);
        assert_eq!(l.check(0, Content::Torn), Verdict::TornUnacknowledged);
        assert_eq!(l.check(0, Content::Torn), Verdict::Ok);
        // A new write into it, unacknowledged, torn again: counted again.
        l.issue(0);
        assert_eq!(l.check(0, Content::Torn), Verdict::TornUnacknowledged);
    }

    #[test]
    fn check_all_tallies_a_namespace() {
        let mut l = Ledger::new(3);
        let g = l.issue(0);
        l.ack(0, g);
        let g = l.issue(1);
        l.ack(1, g);
        let mut data = encode(0, 1, 0);
        data.extend_from_slice(&[0; BLOCK]); // block 1: lost
        data.extend_from_slice(&[0; BLOCK]); // block 2: never written
        let (t, bad) = l.check_all(&data);
        assert_eq!(
            t,
            Tally {
                acknowledged_checked: 2,
                lost: 1,
                torn_unacknowledged: 0,
                corrupt: 0
            }
        );
        assert_eq!(bad, [(1, Verdict::Lost, Content::Empty)]);
    }
}
