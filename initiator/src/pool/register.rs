//! The one way a pool registers memory: its slots, and the callers' buffers its requests are
//! on; where the argument that this registration is sound lives.

use std::sync::Arc;

use rpma_common::fabric::{self, Access, AlignedBuf, MemoryRegion, ProtectionDomain};

/// Registers memory the pool writes from or reads into: the slots, and the callers' buffers its
/// requests are on.
pub(super) fn register(
    pd: &ProtectionDomain,
    mem: &Arc<AlignedBuf>,
) -> fabric::Result<Arc<MemoryRegion>> {
    // SAFETY: nothing writes bytes of a slot or a WriteBuf while a Write reads them. A slot
    // is loaded only while taken and not in flight, and written from until its write is done
    // with (made durable, or dropped with a queue pair that is gone); a Read goes into a slot
    // of its own. The owner writes a WriteBuf only while nothing holds it
    // (`WriteBuf::bytes_mut`); a Read goes into a WriteBuf only while no write from it is held
    // (`Queue::start_read_into` refuses), and no write goes out from one while a Read into it
    // is held (`from_buf` in namespace.rs refuses; the NBD export, which builds its writes'
    // data itself, reads into its reply buffers and writes from its payload buffers only:
    // `Callers::put` asserts it in debug builds). The target reaches neither (local access only).
    unsafe { pd.register_stable(Arc::clone(mem), Access::LOCAL_WRITE) }
}
