//! Fuzz target `mpa_handshake`: rpma_common::fuzz::mpa_handshake (its docs say what is checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rpma_common::fuzz::mpa_handshake(data));
