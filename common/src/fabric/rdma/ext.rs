//! The extended verbs (`ibv_query_device_ex`, `ibv_create_qp_ex`, `ibv_query_port`) called
//! through the provider's `verbs_context` ops, as rdma-core's inline wrappers in `verbs.h` do.
//!
//! rdma-sys 0.3.0 re-implements those inline wrappers in Rust, but its `verbs_get_ctx` compares
//! `ibv_context.abi_compat` with `u32::MAX`, where rdma-core marks an extended context with
//! `__VERBS_ABI_IS_EXTENDED`, `(void *)UINTPTR_MAX`. On a 64-bit host the two never match, so
//! every rdma-sys wrapper built on `verbs_get_ctx_op!` takes its fallback: `ibv_query_device_ex`
//! degrades to `ibv_query_device` and reports no ODP and no `device_cap_flags_ex` (Atomic Write)
//! on devices that have them, and `ibv_create_qp_ex` with send-ops flags fails with
//! EOPNOTSUPP. Found on Soft-RoCE (docs/rdma.md, "rdma-sys"); this module is the work-around:
//! the same lookup with the right marker, then the provider's op.

use std::mem::{offset_of, size_of};
use std::os::raw::c_int;
use std::ptr::NonNull;

use rdma_sys::{
    ibv_context, ibv_device_attr_ex, ibv_port_attr, ibv_qp, ibv_qp_init_attr_ex, verbs_context,
};

/// rdma-core's `__VERBS_ABI_IS_EXTENDED`: the `abi_compat` of a context that is the last
/// member of a `verbs_context`.
const VERBS_ABI_IS_EXTENDED: usize = usize::MAX;

/// The `verbs_context` that holds `ctx`, if the provider made an extended one (all providers
/// of rdma-core 17 and later do).
///
/// # Safety
/// `ctx` must point to a live `ibv_context`.
unsafe fn verbs_ctx(ctx: *mut ibv_context) -> Option<NonNull<verbs_context>> {
    // SAFETY: the caller promises a live context; abi_compat is a plain field of it.
    if unsafe { (*ctx).abi_compat } as usize != VERBS_ABI_IS_EXTENDED {
        return None;
    }
    // `context` is the last member of `verbs_context` (rdma-core's container_of).
    let base = ctx
        .cast::<u8>()
        .wrapping_sub(offset_of!(verbs_context, context));
    NonNull::new(base.cast::<verbs_context>())
}

/// Whether the provider's `verbs_context` is large enough to hold the op at `offset` (ops are
/// added at the front of the struct, so an older provider's `sz` stops short of new ones), as
/// rdma-core's `verbs_get_ctx_op` checks.
///
/// # Safety
/// `vc` must come from [`verbs_ctx`] on a live context.
unsafe fn has_room_for(vc: NonNull<verbs_context>, offset: usize) -> bool {
    // SAFETY: the caller promises a live extended context; sz is its first field.
    let sz = unsafe { (*vc.as_ptr()).sz };
    sz >= size_of::<verbs_context>() - offset
}

/// `ibv_query_device_ex(ctx, NULL, attr)` as `verbs.h` defines it: the provider's
/// `query_device_ex`, or `ibv_query_device` (the extended part left zero) where there is
/// none or it answers EOPNOTSUPP. Returns 0 or an errno value.
///
/// # Safety
/// `ctx` must point to a live context and `attr` to writable memory of its type.
pub(super) unsafe fn query_device_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr_ex,
) -> c_int {
    // SAFETY: the caller promises a live context.
    if let Some(vc) = unsafe { verbs_ctx(ctx) } {
        // SAFETY: as above; the offset is of a field of verbs_context.
        let op = if unsafe { has_room_for(vc, offset_of!(verbs_context, query_device_ex)) } {
            // SAFETY: the provider's struct reaches this field (checked just above).
            unsafe { (*vc.as_ptr()).query_device_ex }
        } else {
            None
        };
        if let Some(op) = op {
            // SAFETY: the provider's own op for this context, called as verbs.h calls it: a
            // NULL input asks for the default query, `attr` is of the size passed.
            let r = unsafe { op(ctx, std::ptr::null(), attr, size_of::<ibv_device_attr_ex>()) };
            if r != libc::EOPNOTSUPP {
                return r;
            }
        }
    }
    // SAFETY: the caller promises `attr` is writable: zero the extended part the fallback
    // leaves, then let the legacy query fill the original part.
    unsafe {
        std::ptr::write_bytes(attr, 0, 1);
        rdma_sys::ibv_query_device(ctx, &mut (*attr).orig_attr)
    }
}

/// `ibv_create_qp_ex(ctx, attr)` as `verbs.h` defines it. Returns NULL with errno set on
/// failure (EOPNOTSUPP where the provider has no extended queue pairs).
///
/// # Safety
/// `ctx` must point to a live context and `attr` to a filled `ibv_qp_init_attr_ex` whose PD
/// and completion queues are of that context.
pub(super) unsafe fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    // SAFETY: the caller promises a live context.
    if let Some(vc) = unsafe { verbs_ctx(ctx) } {
        // SAFETY: as above; the offset is of a field of verbs_context.
        if unsafe { has_room_for(vc, offset_of!(verbs_context, create_qp_ex)) } {
            // SAFETY: the provider's struct reaches this field (checked just above).
            if let Some(op) = unsafe { (*vc.as_ptr()).create_qp_ex } {
                // SAFETY: the provider's own op, with the caller's valid attributes.
                return unsafe { op(ctx, attr) };
            }
        }
    }
    // SAFETY: errno is thread-local and always writable.
    unsafe { *libc::__errno_location() = libc::EOPNOTSUPP };
    std::ptr::null_mut()
}

/// `ibv_query_port(ctx, port, attr)` as `verbs.h` defines it: the provider's `query_port`
/// (which fills the whole `ibv_port_attr`), or rdma-sys's compat fallback. Returns 0 or an
/// errno value.
///
/// # Safety
/// `ctx` must point to a live context and `attr` to writable memory of its type.
pub(super) unsafe fn query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller promises a live context.
    if let Some(vc) = unsafe { verbs_ctx(ctx) } {
        // SAFETY: as above; the offset is of a field of verbs_context.
        if unsafe { has_room_for(vc, offset_of!(verbs_context, query_port)) } {
            // SAFETY: the provider's struct reaches this field (checked just above).
            if let Some(op) = unsafe { (*vc.as_ptr()).query_port } {
                // SAFETY: the provider's own op, `attr` of the size passed.
                return unsafe { op(ctx, port, attr, size_of::<ibv_port_attr>()) };
            }
        }
    }
    // SAFETY: the caller's live context and writable attr, as rdma-sys's wrapper needs.
    unsafe { rdma_sys::___ibv_query_port(ctx, port, attr) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider's extended context, made in memory: what rdma-core's providers allocate
    /// (`verbs_init_and_alloc_context`), with the marker rdma-core sets.
    fn fake_context() -> Box<verbs_context> {
        // SAFETY: verbs_context is plain C data (pointers, integers, optional fn pointers):
        // all-zero is a valid value of it.
        let mut vc: Box<verbs_context> = Box::new(unsafe { std::mem::zeroed() });
        vc.sz = size_of::<verbs_context>();
        vc.context.abi_compat = VERBS_ABI_IS_EXTENDED as *mut std::ffi::c_void;
        vc
    }

    unsafe extern "C" fn fake_query(
        _ctx: *mut ibv_context,
        _input: *const rdma_sys::ibv_query_device_ex_input,
        attr: *mut ibv_device_attr_ex,
        size: usize,
    ) -> c_int {
        assert_eq!(size, size_of::<ibv_device_attr_ex>());
        // SAFETY: query_device_ex passes the caller's attr, valid for writes.
        unsafe {
            (*attr).odp_caps.general_caps = 1;
            (*attr).odp_caps.per_transport_caps.rc_odp_caps = 0xff;
            (*attr).device_cap_flags_ex = 1 << 40;
        }
        0
    }

    #[test]
    fn an_extended_context_is_found_with_rdma_cores_marker() {
        let mut vc = fake_context();
        let ctx: *mut ibv_context = &mut vc.context;
        // SAFETY: `ctx` is the context member of a live verbs_context.
        let found = unsafe { verbs_ctx(ctx) }.expect("the UINTPTR_MAX marker is extended");
        assert_eq!(found.as_ptr(), &mut *vc as *mut verbs_context);
        // rdma-sys 0.3.0 looks for u32::MAX: on 64 bits that is not the marker.
        assert_ne!(u32::MAX as usize, VERBS_ABI_IS_EXTENDED);
        // A legacy context (abi_compat NULL) is not extended.
        vc.context.abi_compat = std::ptr::null_mut();
        // SAFETY: as above.
        assert!(unsafe { verbs_ctx(&mut vc.context) }.is_none());
    }

    #[test]
    fn query_device_ex_reaches_the_providers_op() {
        let mut vc = fake_context();
        vc.query_device_ex = Some(fake_query);
        // SAFETY: ibv_device_attr_ex is plain C data.
        let mut attr: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        // SAFETY: a live (fake) extended context whose op writes only `attr`.
        let r = unsafe { query_device_ex(&mut vc.context, &mut attr) };
        assert_eq!(r, 0);
        assert_eq!(attr.odp_caps.general_caps, 1);
        assert_eq!(attr.odp_caps.per_transport_caps.rc_odp_caps, 0xff);
        assert_eq!(attr.device_cap_flags_ex, 1 << 40);
    }

    #[test]
    fn an_op_beyond_an_older_providers_struct_is_not_called() {
        let mut vc = fake_context();
        vc.query_device_ex = Some(fake_query);
        vc.create_qp_ex = None;
        // A provider built against an older verbs_context: its struct starts after the op.
        vc.sz = size_of::<verbs_context>() - offset_of!(verbs_context, query_device_ex) - 8;
        let vcp = NonNull::from(&mut *vc);
        // SAFETY: a live (fake) extended context.
        assert!(!unsafe { has_room_for(vcp, offset_of!(verbs_context, query_device_ex)) });
        // SAFETY: as above.
        assert!(unsafe { has_room_for(vcp, offset_of!(verbs_context, context)) });
        // And create_qp_ex without an op fails with EOPNOTSUPP rather than calling NULL.
        vc.sz = size_of::<verbs_context>();
        // SAFETY: ibv_qp_init_attr_ex is plain C data.
        let mut a: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        // SAFETY: a live (fake) extended context without the op.
        let qp = unsafe { create_qp_ex(&mut vc.context, &mut a) };
        assert!(qp.is_null());
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EOPNOTSUPP)
        );
    }
}
