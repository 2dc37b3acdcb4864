//! CPU cache write-back: the instructions that move stores from the CPU caches to the memory
//! controller, where persistent memory keeps them across power loss (the ADR domain).
//!
//! The instruction is chosen once per process by CPUID: `clwb` (writes back and may keep the
//! line), else `clflushopt` (writes back and evicts, weakly ordered), else `clflush` (strongly
//! ordered, serialising). `clwb` and `clflushopt` need an `sfence` afterwards before the data can
//! be called durable; [`sfence`] is that fence.

use std::fmt;
use std::sync::OnceLock;

use super::error::{Error, Result};

/// A cache write-back instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushInstruction {
    /// CLWB: write back, keep the line valid (CPUID.(EAX=7,ECX=0):EBX bit 24).
    Clwb,
    /// CLFLUSHOPT: write back and invalidate, weakly ordered (CPUID.(EAX=7,ECX=0):EBX bit 23).
    Clflushopt,
    /// CLFLUSH: write back and invalidate, ordered with other stores (CPUID.01H:EDX bit 19).
    Clflush,
    /// No cache write-back instruction is known on this architecture.
    None,
}

impl FlushInstruction {
    /// The mnemonic, lower case ("clwb", ...; "none").
    pub fn as_str(&self) -> &'static str {
        match self {
            FlushInstruction::Clwb => "clwb",
            FlushInstruction::Clflushopt => "clflushopt",
            FlushInstruction::Clflush => "clflush",
            FlushInstruction::None => "none",
        }
    }

    /// Whether this CPU executes the instruction. [`FlushInstruction::None`] is always
    /// "supported" (it does nothing).
    pub fn is_supported(&self) -> bool {
        let f = cpu_features();
        match self {
            FlushInstruction::Clwb => f.clwb,
            FlushInstruction::Clflushopt => f.clflushopt,
            FlushInstruction::Clflush => f.clflush,
            FlushInstruction::None => true,
        }
    }

    /// Every write-back instruction this CPU has, strongest first (clwb, clflushopt, clflush).
    pub fn available() -> Vec<FlushInstruction> {
        [
            FlushInstruction::Clwb,
            FlushInstruction::Clflushopt,
            FlushInstruction::Clflush,
        ]
        .into_iter()
        .filter(FlushInstruction::is_supported)
        .collect()
    }
}

impl fmt::Display for FlushInstruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy)]
struct CpuFeatures {
    clwb: bool,
    clflushopt: bool,
    clflush: bool,
    /// Bytes written back by one instruction.
    line: usize,
}

fn cpu_features() -> CpuFeatures {
    static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
    *FEATURES.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuFeatures {
    use core::arch::x86_64::{__cpuid, __cpuid_count};
    let max_leaf = __cpuid(0).eax;
    let leaf1 = __cpuid(1);
    let clflush = leaf1.edx & (1 << 19) != 0;
    // CPUID.01H:EBX[15:8] is the CLFLUSH line size in 8-byte units.
    let line = match ((leaf1.ebx >> 8) & 0xff) as usize * 8 {
        0 => 64,
        n => n,
    };
    let (clwb, clflushopt) = if max_leaf >= 7 {
        let leaf7 = __cpuid_count(7, 0);
        (leaf7.ebx & (1 << 24) != 0, leaf7.ebx & (1 << 23) != 0)
    } else {
        (false, false)
    };
    CpuFeatures {
        clwb,
        clflushopt,
        clflush,
        line,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures {
        clwb: false,
        clflushopt: false,
        clflush: false,
        line: 64,
    }
}

/// The write-back instruction [`writeback_range`] uses on this CPU: the strongest it has, chosen
/// once by CPUID. [`FlushInstruction::None`] off x86-64.
pub fn flush_instruction() -> FlushInstruction {
    static CHOSEN: OnceLock<FlushInstruction> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        FlushInstruction::available()
            .first()
            .copied()
            .unwrap_or(FlushInstruction::None)
    })
}

/// Bytes covered by one write-back instruction (the CLFLUSH line size from CPUID, 64 when unknown).
pub fn cache_line_size() -> usize {
    cpu_features().line
}

/// Writes back every cache line that overlaps `[ptr, ptr + len)` with [`flush_instruction`],
/// without a fence: follow with [`sfence`] before calling the range durable. `len == 0` does
/// nothing. Off x86-64 it does nothing at all (the mapping layer then uses msync instead).
///
/// # Safety
///
/// `[ptr, ptr + len)` must lie within one live mapping of this process (the instructions fault on
/// unmapped addresses, like a load would). The bytes need not be initialised or aligned.
pub unsafe fn writeback_range(ptr: *const u8, len: usize) {
    // SAFETY: the caller's contract is this function's, and the instruction was checked by CPUID.
    unsafe { writeback_unchecked(flush_instruction(), ptr, len) }
}

/// [`writeback_range`] with a given instruction, for benchmarks and tests that compare them.
///
/// Errors: [`Error::UnsupportedInstruction`] if this CPU lacks `instruction`.
///
/// # Safety
///
/// As for [`writeback_range`]: `[ptr, ptr + len)` must lie within one live mapping of this process.
pub unsafe fn writeback_range_with(
    instruction: FlushInstruction,
    ptr: *const u8,
    len: usize,
) -> Result<()> {
    if !instruction.is_supported() {
        return Err(Error::UnsupportedInstruction {
            instruction: instruction.as_str(),
        });
    }
    // SAFETY: the instruction is supported (checked above); the range is the caller's contract.
    unsafe { writeback_unchecked(instruction, ptr, len) };
    Ok(())
}

/// # Safety
///
/// `instruction` must be supported by this CPU, and `[ptr, ptr + len)` lie within a live mapping.
#[cfg(target_arch = "x86_64")]
unsafe fn writeback_unchecked(instruction: FlushInstruction, ptr: *const u8, len: usize) {
    use core::arch::asm;
    if len == 0 {
        return;
    }
    let line = cache_line_size();
    let end = (ptr as usize).saturating_add(len);
    let mut p = (ptr as usize) & !(line - 1);
    // The asm blocks below are not `nomem`, so the compiler keeps every earlier store before them.
    match instruction {
        FlushInstruction::Clwb => {
            while p < end {
                // SAFETY: CLWB is supported (caller), and p is in a cache line that overlaps the
                // caller's mapped range, so it is mapped; CLWB does not change memory contents.
                unsafe { asm!("clwb [{0}]", in(reg) p, options(nostack, preserves_flags)) };
                p += line;
            }
        }
        FlushInstruction::Clflushopt => {
            while p < end {
                // SAFETY: as for CLWB: supported, and the line is mapped; contents are unchanged.
                unsafe { asm!("clflushopt [{0}]", in(reg) p, options(nostack, preserves_flags)) };
                p += line;
            }
        }
        FlushInstruction::Clflush => {
            while p < end {
                // SAFETY: CLFLUSH is supported (caller) and the line is mapped; contents unchanged.
                unsafe { core::arch::x86_64::_mm_clflush(p as *const u8) };
                p += line;
            }
        }
        FlushInstruction::None => {}
    }
}

/// # Safety
///
/// Nothing to uphold off x86-64: this does nothing.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn writeback_unchecked(_instruction: FlushInstruction, _ptr: *const u8, _len: usize) {}

/// Orders every earlier store and cache write-back before every later store: after
/// [`writeback_range`] + `sfence`, the range has reached the memory controller.
pub fn sfence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SFENCE has no operands and no preconditions; SSE is baseline on x86-64.
    unsafe {
        core::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chosen_instruction_is_the_strongest_available() {
        let avail = FlushInstruction::available();
        match avail.first() {
            Some(first) => assert_eq!(flush_instruction(), *first),
            None => assert_eq!(flush_instruction(), FlushInstruction::None),
        }
        assert!(flush_instruction().is_supported());
        #[cfg(target_arch = "x86_64")]
        assert!(
            FlushInstruction::Clflush.is_supported(),
            "every x86-64 CPU has clflush"
        );
    }

    #[test]
    fn cache_line_is_a_power_of_two() {
        let line = cache_line_size();
        assert!(line.is_power_of_two() && line >= 32, "line size {line}");
    }

    #[test]
    fn every_available_instruction_writes_back_without_changing_data() {
        let mut buf = vec![0u8; 4096 + 3];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        for instr in FlushInstruction::available() {
            // Unaligned start and length, crossing several lines.
            // SAFETY: [buf+1, buf+1+4096) lies within the live Vec allocation.
            unsafe { writeback_range_with(instr, buf.as_ptr().add(1), 4096).unwrap() };
            sfence();
            // SAFETY: zero length touches nothing.
            unsafe { writeback_range_with(instr, buf.as_ptr(), 0).unwrap() };
        }
        // SAFETY: the range is the Vec's.
        unsafe { writeback_range(buf.as_ptr().add(5), 70) };
        sfence();
        assert!(buf.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    }

    #[test]
    fn unsupported_instruction_is_refused() {
        let missing = [
            FlushInstruction::Clwb,
            FlushInstruction::Clflushopt,
            FlushInstruction::Clflush,
        ]
        .into_iter()
        .find(|i| !i.is_supported());
        let Some(missing) = missing else {
            eprintln!("skipped: this CPU has every write-back instruction");
            return;
        };
        let buf = [0u8; 64];
        // SAFETY: the range is the array's; the call must refuse before touching it.
        let err = unsafe { writeback_range_with(missing, buf.as_ptr(), 64) }.unwrap_err();
        assert!(matches!(err, Error::UnsupportedInstruction { .. }), "{err}");
        assert!(err.to_string().contains(missing.as_str()));
    }
}
