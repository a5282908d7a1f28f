//! How a worker ended, as the agent reports it.

use std::process::ExitStatus;

/// How one worker ended.
#[derive(Debug, Clone)]
pub(super) struct Exit {
    pub(super) rank: usize,
    pub(super) status: ExitStatus,
    pub(super) tail: Vec<String>,
    /// What happened, when the status does not say (a hung worker).
    pub(super) note: Option<String>,
}

impl Exit {
    pub(super) fn describe(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        if let Some(n) = &self.note {
            return n.clone();
        }
        match (self.status.code(), self.status.signal()) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("signal {s}"),
            _ => "unknown status".into(),
        }
    }

    pub(super) fn code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        self.status
            .code()
            .unwrap_or_else(|| 128 + self.status.signal().unwrap_or(1))
    }
}
