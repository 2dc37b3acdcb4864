//! Persistent-memory layer (being built under the workspace issue).
