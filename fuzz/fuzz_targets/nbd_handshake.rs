//! Fuzz target `nbd_handshake`: rpma_initiator::nbd::fuzz::handshake (its docs say what is
//! checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rpma_initiator::nbd::fuzz::handshake(data));
