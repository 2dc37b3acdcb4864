//! A bounds-checked big-endian reader over a byte slice: every read past the end is a
//! [`WireError::Truncated`], never a panic. No unsafe.

use super::error::{Result, WireError};

/// Reads big-endian fields from a slice, front to back.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`; `what` names the structure in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The unread rest, without consuming it.
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }

    /// The next `n` bytes.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than `n` bytes are left.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(WireError::Truncated {
                what: self.what,
                need: self.pos.saturating_add(n),
                have: self.buf.len(),
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than `N` bytes are left.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    /// One byte.
    ///
    /// # Errors
    /// [`WireError::Truncated`] at the end.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    /// A big-endian u16.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 2 bytes are left.
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    /// A big-endian u32.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 4 bytes are left.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    /// A big-endian u64.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than 8 bytes are left.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// Skips `n` bytes.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if fewer than `n` bytes are left.
    pub fn skip(&mut self, n: usize) -> Result<()> {
        self.bytes(n).map(|_| ())
    }
}

/// Appends big-endian fields to a fixed array; used by the encoders, whose sizes are constants.
#[derive(Debug)]
pub(crate) struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        Writer { buf, pos: 0 }
    }

    /// Panics if the buffer is too small: callers size it from the layout's constants.
    pub(crate) fn put(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
        self
    }

    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.put(&[v])
    }

    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.put(&v.to_be_bytes())
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.put(&v.to_be_bytes())
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.put(&v.to_be_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_big_endian_fields_in_order() {
        let buf = [1, 0x02, 0x03, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let mut r = Reader::new(&buf, "t");
        assert_eq!(r.u8().unwrap(), 1);
        assert_eq!(r.u16().unwrap(), 0x0203);
        assert_eq!(r.u32().unwrap(), 0x0405_0607);
        assert_eq!(r.u64().unwrap(), 0x0809_0a0b_0c0d_0e0f);
        assert_eq!(r.remaining(), 0);
        assert_eq!(r.position(), 15);
    }

    #[test]
    fn short_input_is_an_error_not_a_panic() {
        let buf = [1, 2, 3];
        let mut r = Reader::new(&buf, "thing");
        match r.u32() {
            Err(WireError::Truncated {
                what: "thing",
                need: 4,
                have: 3,
            }) => {}
            other => panic!("unexpected {other:?}"),
        }
        // A failed read consumes nothing.
        assert_eq!(r.u16().unwrap(), 0x0102);
        assert!(r.u16().is_err());
        assert!(r.bytes(usize::MAX).is_err());
        assert!(r.skip(2).is_err());
        assert_eq!(r.rest(), &[3]);
    }

    #[test]
    fn writer_puts_big_endian() {
        let mut buf = [0u8; 15];
        let mut w = Writer::new(&mut buf);
        w.u8(1)
            .u16(0x0203)
            .u32(0x0405_0607)
            .u64(0x0809_0a0b_0c0d_0e0f);
        assert_eq!(buf, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
    }
}
