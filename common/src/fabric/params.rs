//! Connection parameters and what a connection agreed: plain data every transport reads the
//! same way, with the `tcp` transport's own knobs in their own part ([`TcpParams`],
//! [`TcpInfo`]).

use std::net::SocketAddr;
use std::time::Duration;

/// Connection parameters: what this side offers when connecting or accepting. Those of one
/// transport are in its own part ([`ConnParams::tcp`]); the others mean the same on every
/// transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParams {
    /// Inbound Read/Atomic/Flush requests this side serves at once (IRD).
    pub ird: u16,
    /// Outbound Read/Atomic/Flush requests this side keeps in flight (ORD); lowered to the
    /// peer's IRD when the connection is made.
    pub ord: u16,
    /// Largest message (Write, Read, Send) this side posts or serves; a peer's Read Request for
    /// more is answered with a Terminate.
    pub max_message: usize,
    /// How long a connect or accept may take.
    pub timeout: Duration,
    /// What the `tcp` transport offers in the MPA exchange (ignored by other transports).
    pub tcp: TcpParams,
}

impl Default for ConnParams {
    fn default() -> Self {
        ConnParams {
            ird: 16,
            ord: 16,
            max_message: 1 << 30,
            timeout: Duration::from_secs(10),
            tcp: TcpParams::default(),
        }
    }
}

/// The `tcp` transport's connection parameters: its MPA knobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpParams {
    /// Ask for MPA CRC32c (on by default). CRC is used if either side asks.
    pub crc: bool,
    /// Largest ULPDU (DDP header + payload) this side sends in one FPDU; longer messages are
    /// segmented. 128..=65535; 65535 by default. The engine also keeps every FPDU within one
    /// TCP segment of the connection (RFC 5044's MULPDU, from the socket's MSS): about 1442
    /// on a 1500-byte MTU, about 32 KiB on loopback.
    pub max_ulpdu: usize,
}

impl TcpParams {
    /// The most private data a connect or accept may carry on this transport: 256 bytes of
    /// MPA private data (what Linux siw accepts) less the 4-byte IRD/ORD prefix and this
    /// project's 12-byte capability block. (The transport checks at compile time that its
    /// framing agrees.)
    pub const MAX_PRIVATE_DATA: usize = 240;

    /// The largest ULPDU an FPDU can carry: MPA's 16-bit length field.
    pub const MAX_ULPDU: usize = u16::MAX as usize;
}

impl Default for TcpParams {
    fn default() -> Self {
        TcpParams {
            crc: true,
            max_ulpdu: TcpParams::MAX_ULPDU,
        }
    }
}

/// What was agreed when the connection was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnInfo {
    /// Inbound requests this side serves at once.
    pub ird: u16,
    /// Outbound requests this side keeps in flight.
    pub ord: u16,
    /// The peer understands Flush (RDMA Flush: the private opcode on `tcp`).
    pub peer_flush: bool,
    /// The peer understands Atomic Write (the private opcode on `tcp`).
    pub peer_atomic_write: bool,
    /// The peer understands RFC 7306 atomics.
    pub peer_atomics: bool,
    /// The application private data the peer sent.
    pub peer_private_data: Vec<u8>,
    /// The local socket address.
    pub local_addr: SocketAddr,
    /// The peer's socket address.
    pub peer_addr: SocketAddr,
    /// What the `tcp` transport agreed in the MPA exchange (`None` on other transports).
    pub tcp: Option<TcpInfo>,
}

/// What the `tcp` transport agreed in the MPA exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpInfo {
    /// Whether FPDUs carry CRC32c.
    pub crc: bool,
}
