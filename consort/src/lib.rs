//! consort facade
