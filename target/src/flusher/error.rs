//! The flush service's errors.

/// Errors of the flush service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FlusherError {
    /// The eventfd could not be created.
    #[error("cannot create the flusher's eventfd")]
    EventFd(#[source] std::io::Error),
    /// The worker thread (fallback) could not be started.
    #[error("cannot start the flusher's worker thread")]
    Thread(#[source] std::io::Error),
    /// The backing file could not be opened again for the flush service.
    #[error("cannot open the namespace's file again for its flushes")]
    Reopen(#[source] std::io::Error),
    /// A page-cache mapping without a backing file.
    #[error("a page-cache namespace has no backing file to flush")]
    NoBackingFile,
    /// As many flushes are in flight as the flusher was sized for.
    #[error("{0} flushes in flight: the flusher is full")]
    Full(usize),
    /// io_uring refused the submission.
    #[error("io_uring submission failed")]
    Submit(#[source] std::io::Error),
}

/// Result of the flush service.
pub type Result<T> = std::result::Result<T, FlusherError>;
