//! [`PersistMethod`]: the ways to make placed bytes durable, named apart from the choice of one
//! ([`durability`](crate::durability)) so that errors can name a method without depending on
//! the choosing.

use std::fmt;

use rpma_common::proto::DurabilityMethods;

/// A way to make placed bytes durable (docs/initiator.md, "Durability").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PersistMethod {
    /// Appliance persistency: Write(s), then an 8-byte Read on the same queue pair.
    Apm,
    /// General-purpose server persistency: a FlushRequest Send, answered by a FlushResponse.
    Gpspm,
    /// The native Flush work request (Persistent, range).
    Flush,
}

impl PersistMethod {
    /// The descriptor bit of this method.
    pub fn bit(self) -> DurabilityMethods {
        match self {
            PersistMethod::Apm => DurabilityMethods::APM,
            PersistMethod::Gpspm => DurabilityMethods::GPSPM,
            PersistMethod::Flush => DurabilityMethods::FLUSH,
        }
    }

    /// Lower-case name, as the CLI takes it.
    pub fn name(self) -> &'static str {
        match self {
            PersistMethod::Apm => "apm",
            PersistMethod::Gpspm => "gpspm",
            PersistMethod::Flush => "flush",
        }
    }
}

impl fmt::Display for PersistMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PersistMethod::Apm => "APM",
            PersistMethod::Gpspm => "GPSPM",
            PersistMethod::Flush => "FLUSH",
        })
    }
}
