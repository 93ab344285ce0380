//! How `rpcctl` ends: a message on standard error and an exit code scripts can trust.

/// Why a command did not succeed, and the exit code that says so.
#[derive(Debug)]
pub struct Failure {
    /// The exit code: 1 the operation failed, 2 the command line or configuration is wrong.
    pub code: i32,
    /// What went wrong and what to do next.
    pub message: String,
}

impl Failure {
    /// The operation failed: the remote side refused, a call failed, a rule was invalid.
    pub fn failed(message: impl Into<String>) -> Self {
        Failure {
            code: 1,
            message: message.into(),
        }
    }

    /// The command line or its configuration is wrong.
    pub fn usage(message: impl Into<String>) -> Self {
        Failure {
            code: 2,
            message: message.into(),
        }
    }
}
