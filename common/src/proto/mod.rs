//! Control-plane messages: Connect, auth, ConnectResponse, flush, keep-alive, discovery.
