//! Helpers for the integration tests in `tests/tests/`.
