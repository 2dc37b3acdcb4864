//! The verbs calls that make a queue pair and post to it: `ibv_create_qp` (or `_ex`, for the
//! `ibv_wr_*` path that has Atomic Write), and the two posting paths, each given requests
//! already checked and translated (`translate::WrSpec`) with their hardware `wr_id`s.

use std::ptr::NonNull;

use rdma_sys::{
    ibv_qp, ibv_qp_create_send_ops_flags as so, ibv_qp_ex, ibv_qp_init_attr_mask, ibv_qp_type,
    ibv_send_wr, ibv_sge, ibv_wr_opcode,
};

use super::device::{Device, Pd};
use super::ext;
use super::sys;
use super::translate::{self, WrSpec};
use crate::fabric::error::{Error, Result};

/// Makes the `ibv_qp` (extended when the device has Atomic Write; the plain one if the
/// provider cannot make that).
pub(super) fn create_raw(
    dev: &Device,
    pd: &Pd,
    scq: *mut rdma_sys::ibv_cq,
    rcq: *mut rdma_sys::ibv_cq,
    send: u32,
    recv: u32,
) -> Result<(NonNull<ibv_qp>, Option<NonNull<ibv_qp_ex>>)> {
    let cap = rdma_sys::ibv_qp_cap {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    if dev.caps().atomic_write {
        // SAFETY: ibv_qp_init_attr_ex is plain C data; zero is "not set" for every field.
        let mut a: rdma_sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        a.send_cq = scq;
        a.recv_cq = rcq;
        a.cap = cap;
        a.qp_type = ibv_qp_type::IBV_QPT_RC;
        a.pd = pd.raw();
        a.comp_mask = (ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD
            | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
            .0;
        a.send_ops_flags = u64::from(
            (so::IBV_QP_EX_WITH_RDMA_WRITE
                | so::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
                | so::IBV_QP_EX_WITH_SEND
                | so::IBV_QP_EX_WITH_SEND_WITH_INV
                | so::IBV_QP_EX_WITH_RDMA_READ
                | so::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
                | so::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
                | so::IBV_QP_EX_WITH_BIND_MW
                | so::IBV_QP_EX_WITH_ATOMIC_WRITE)
                .0,
        );
        // SAFETY: the context, PD and CQs are live and of one device; `a` is filled above.
        // (Not rdma-sys's wrapper, which never finds the provider's op: ext.rs.)
        let qp = unsafe { ext::create_qp_ex(dev.ctx(), &mut a) };
        if let Some(qp) = NonNull::new(qp) {
            // SAFETY: `qp` was made by ibv_create_qp_ex, so it has an extended part.
            let ex = NonNull::new(unsafe { rdma_sys::ibv_qp_to_qp_ex(qp.as_ptr()) });
            if ex.is_some() {
                return Ok((qp, ex));
            }
            // SAFETY: just made, used by nothing.
            unsafe { rdma_sys::ibv_destroy_qp(qp.as_ptr()) };
        }
    }
    let mut a = rdma_sys::ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: scq,
        recv_cq: rcq,
        srq: std::ptr::null_mut(),
        cap,
        qp_type: ibv_qp_type::IBV_QPT_RC,
        sq_sig_all: 0,
    };
    // SAFETY: the PD and CQs are live and of one device; `a` is valid.
    let qp = unsafe { rdma_sys::ibv_create_qp(pd.raw(), &mut a) };
    let qp = NonNull::new(qp).ok_or_else(|| sys::errno("ibv_create_qp"))?;
    Ok((qp, None))
}

/// Posts `specs` through `ibv_post_send` as one chained list. On failure: how many went to
/// the device before the refused one, and the error.
pub(super) fn post_legacy(
    qp: NonNull<ibv_qp>,
    specs: &[(u64, WrSpec)],
) -> std::result::Result<(), (usize, Error)> {
    if specs.is_empty() {
        return Ok(());
    }
    let n = specs.len();
    let mut wrs: Vec<ibv_send_wr> = specs.iter().map(|_| translate::empty_send_wr()).collect();
    let mut sges: Vec<ibv_sge> = vec![
        ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0
        };
        n
    ];
    // Every write below goes through these two pointers, so the pointers the list keeps
    // (`next`, `sg_list`) are derived from them and stay valid: neither vector is touched
    // again until the call returns.
    let base = wrs.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    for (i, (id, spec)) in specs.iter().enumerate() {
        // SAFETY: `i < n`, the length of both vectors; the references made here are the only
        // live ones to those elements.
        unsafe {
            translate::fill_send_wr(spec, *id, &mut *base.add(i), &mut *sge_base.add(i));
            if i + 1 < n {
                (*base.add(i)).next = base.add(i + 1);
            }
        }
    }
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the queue pair is live; the list and its scatter entries outlive the call (the
    // provider copies them into its queue); the buffers they name are held by the caller's
    // slots until the requests complete.
    let r = unsafe { rdma_sys::ibv_post_send(qp.as_ptr(), base, &mut bad) };
    if r == 0 {
        return Ok(());
    }
    let k = if bad.is_null() {
        0
    } else {
        // SAFETY: `bad` points into `wrs` (the provider names the refused request).
        unsafe { bad.offset_from(base) }.clamp(0, specs.len() as isize) as usize
    };
    Err((k, sys::returned("ibv_post_send", r)))
}

/// Posts `specs` through the `ibv_wr_*` calls (the path with Atomic Write). All or nothing.
pub(super) fn post_ex(
    ex: NonNull<ibv_qp_ex>,
    specs: &[(u64, WrSpec)],
) -> std::result::Result<(), (usize, Error)> {
    let q = ex.as_ptr();
    let unsupported = || (0, sys::returned("ibv_wr_*", libc::EOPNOTSUPP));
    // SAFETY: the extended queue pair is live; between ibv_wr_start and ibv_wr_complete (or
    // abort) each request is one opcode call then its scatter entry; every pointer passed is
    // valid for the call (the provider copies into its queue, including Atomic Write's 8
    // bytes); the buffers named are held by the caller's slots until completion.
    unsafe {
        rdma_sys::ibv_wr_start(q);
        for (id, w) in specs {
            (*q).wr_id = *id;
            (*q).wr_flags = w.send_flags;
            let (raddr, rkey) = w.remote.unwrap_or((0, 0));
            let ok = match w.opcode {
                ibv_wr_opcode::IBV_WR_RDMA_WRITE => (*q).wr_rdma_write.map(|f| f(q, rkey, raddr)),
                ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM => (*q)
                    .wr_rdma_write_imm
                    .map(|f| f(q, rkey, raddr, w.imm.unwrap_or(0).to_be())),
                ibv_wr_opcode::IBV_WR_RDMA_READ => (*q).wr_rdma_read.map(|f| f(q, rkey, raddr)),
                ibv_wr_opcode::IBV_WR_SEND => (*q).wr_send.map(|f| f(q)),
                ibv_wr_opcode::IBV_WR_SEND_WITH_INV => (*q)
                    .wr_send_inv
                    .map(|f| f(q, w.invalidate_rkey.unwrap_or(0))),
                ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP => (*q)
                    .wr_atomic_cmp_swp
                    .map(|f| f(q, rkey, raddr, w.compare_add, w.swap)),
                ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD => (*q)
                    .wr_atomic_fetch_add
                    .map(|f| f(q, rkey, raddr, w.compare_add)),
                ibv_wr_opcode::IBV_WR_ATOMIC_WRITE => {
                    let value = w.atomic_value.unwrap_or(0);
                    (*q).wr_atomic_write
                        .map(|f| f(q, rkey, raddr, (&value as *const u64).cast()))
                }
                _ => None,
            };
            if ok.is_none() {
                rdma_sys::ibv_wr_abort(q);
                return Err(unsupported());
            }
            if let Some((addr, len, lkey)) = w.sge {
                match (*q).wr_set_sge {
                    Some(f) => f(q, lkey, addr, len),
                    None => {
                        rdma_sys::ibv_wr_abort(q);
                        return Err(unsupported());
                    }
                }
            }
        }
        let r = rdma_sys::ibv_wr_complete(q);
        if r != 0 {
            return Err((0, sys::returned("ibv_wr_complete", r)));
        }
    }
    Ok(())
}
