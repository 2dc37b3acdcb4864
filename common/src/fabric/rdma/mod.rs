//! `rdma`: libibverbs/librdmacm (cargo feature `rdma`). A skeleton: its types have no values
//! yet, so [`Context::for_url`](super::Context::for_url) refuses `rdma://`, and what it shows is
//! that a transport slots in behind the seam (`transport`) without a change above the fabric.
//! Filling it in gives each type its verbs object (`ibv_context`, `ibv_cq` with its completion
//! channel, `ibv_qp`, `rdma_cm_id`).

/// No value: nothing of the skeleton can be made.
#[derive(Debug)]
pub(crate) enum Never {}

/// An open verbs device.
pub(crate) type Device = Never;
/// A verbs completion queue.
pub(crate) type Cq = Never;
/// A verbs queue pair.
pub(crate) type Qp = Never;
/// An rdma_cm listening id.
pub(crate) type Listen = Never;
