//! Fuzz target `target_handshake`: rpma_target::handshake::fuzz::connect_sequence (its docs
//! say what is checked).
#![no_main]

use rpma_target::handshake::fuzz::connect_sequence;

libfuzzer_sys::fuzz_target!(|data: &[u8]| connect_sequence(data));
