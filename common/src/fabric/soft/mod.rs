//! `tcp`: a userspace RDMA engine over TCP that speaks iWARP (MPA, DDP, RDMAP).

pub mod wire;
