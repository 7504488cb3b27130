//! The actor runtime: local and remote actors, node agents, pools and placement, health and
//! restart, and bulk tensor transport for weight sync.
//!
//! Never: interprets what an actor computes; it moves messages and bytes and watches liveness.
