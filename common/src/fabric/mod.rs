//! The verbs-shaped fabric API and its transports.

pub mod soft;
