//! Fuzz target `target_handshake`: rpma_target::handshake::fuzz::connect_sequence (its docs
//! say what is checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| { rpma_target::handshake::fuzz::connect_sequence(data) });
