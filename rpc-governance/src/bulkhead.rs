//! Bulkhead: the server's concurrency cap. Full means Overflow at once, never a queue.

use std::sync::Arc;

use rpc_core::{RpcError, StatusCode};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Caps calls handled at once.
#[derive(Debug, Clone)]
pub struct Bulkhead {
    slots: Arc<Semaphore>,
    size: usize,
}

impl Bulkhead {
    /// Room for `size` calls at once.
    pub fn new(size: usize) -> Self {
        Bulkhead {
            slots: Arc::new(Semaphore::new(size)),
            size,
        }
    }

    /// The cap.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Calls being handled now.
    pub fn in_use(&self) -> usize {
        self.size - self.slots.available_permits()
    }

    /// Takes a slot for as long as the permit lives, or answers Overflow (515) at once.
    pub fn try_enter(&self, entry: &str) -> Result<OwnedSemaphorePermit, RpcError> {
        self.slots.clone().try_acquire_owned().map_err(|_| {
            RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                format!(
                    "{entry} is at its cap of {} concurrent calls; the call was not run, retry \
                     on another endpoint",
                    self.size
                ),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_means_overflow_at_once() {
        let b = Bulkhead::new(2);
        let p1 = b.try_enter("e").unwrap();
        let _p2 = b.try_enter("e").unwrap();
        let err = b.try_enter("e").unwrap_err();
        assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle);
        assert!(err.message().contains("cap of 2"));
        drop(p1);
        assert_eq!(b.in_use(), 1);
        assert!(b.try_enter("e").is_ok());
    }
}
