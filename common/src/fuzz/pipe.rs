//! [`Pipe`]: the peer of a blocking handshake under fuzzing, in memory.

/// An in-memory stream for the blocking handshakes: reads the peer's bytes (then EOF), keeps
/// what is written.
#[derive(Debug)]
pub struct Pipe<'a> {
    /// What is still to be read.
    pub input: &'a [u8],
    /// What was written.
    pub out: Vec<u8>,
}

impl<'a> Pipe<'a> {
    /// A pipe that will read `input`.
    pub fn new(input: &'a [u8]) -> Pipe<'a> {
        Pipe {
            input,
            out: Vec::new(),
        }
    }
}

impl std::io::Read for Pipe<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::Read::read(&mut self.input, buf)
    }
}

impl std::io::Write for Pipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
