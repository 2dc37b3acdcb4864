//! Fuzz target `fpdu_rx`: rpma_common::fuzz::fpdu_rx (its docs say what is checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rpma_common::fuzz::fpdu_rx(data));
