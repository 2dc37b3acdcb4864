//! rpma-initiator: connect to an rpma target, map remote namespaces and write them durably.
