//! rpma-target: the daemon that serves persistent-memory namespaces to initiators.
//!
//! The binary `rpma-target` is a thin front over this library.

pub mod check;
pub mod config;
pub mod control;
pub mod daemon;
pub mod flusher;
pub mod handshake;
pub mod namespace;
pub mod notify;
pub mod probe;
pub mod reload;
pub mod subsystem;
