//! Fuzz target `control_message`: rpma_common::fuzz::control_message (its docs say what is checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rpma_common::fuzz::control_message(data));
