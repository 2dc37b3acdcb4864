//! iWARP wire formats: MPA, DDP, RDMAP headers; encode and decode, no I/O.
