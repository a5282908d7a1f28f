//! consort-tests: the conformance suite (to be built).
//!
//! It will own one body of tests, instantiated once per backend by a macro,
//! that checks every op, dtype and ReduceOp against a reference over world
//! sizes and lengths, including mismatched calls and faults.
