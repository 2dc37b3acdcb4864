//! Fuzz target `nbd_requests`: rpma_initiator::nbd::fuzz::requests (its docs say what is
//! checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rpma_initiator::nbd::fuzz::requests(data));
