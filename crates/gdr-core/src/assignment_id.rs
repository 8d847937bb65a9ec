//! The assignment ID, in a module of its own: the capability (which names assignments) and
//! the assignment (which is sealed with the capability's keys) both use it, and neither
//! should import the other for it.

use std::fmt;
use std::str::FromStr;

const ID_PREFIX: &str = "gitea-task-";

/// `gitea-task-<task id>`: the stable ID used for JetStream de-duplication, backend
/// metadata and the runner UUID. It is always the canonical spelling of a positive task ID.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AssignmentId {
    text: String,
    task_id: i64,
}

/// Not an assignment ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentIdError {
    /// Gitea task IDs are positive.
    #[error("task ID {0} is not positive")]
    NotPositive(i64),
    /// Not `gitea-task-<positive decimal>` in canonical form.
    #[error("invalid assignment ID {0:?}: expected \"gitea-task-<positive task id>\"")]
    Invalid(String),
}

impl AssignmentId {
    /// The assignment ID of Gitea task `task_id`.
    pub fn from_task_id(task_id: i64) -> Result<Self, AssignmentIdError> {
        if task_id <= 0 {
            return Err(AssignmentIdError::NotPositive(task_id));
        }
        Ok(Self {
            text: format!("{ID_PREFIX}{task_id}"),
            task_id,
        })
    }

    /// Parses the canonical form only (no sign, no leading zeros), so one task has exactly
    /// one assignment ID string.
    pub fn parse(text: &str) -> Result<Self, AssignmentIdError> {
        let invalid = || AssignmentIdError::Invalid(text.to_owned());
        let digits = text.strip_prefix(ID_PREFIX).ok_or_else(invalid)?;
        let task_id: i64 = digits.parse().map_err(|_| invalid())?;
        match Self::from_task_id(task_id) {
            Ok(id) if id.text == text => Ok(id),
            _ => Err(invalid()),
        }
    }

    /// The Gitea task ID.
    pub fn task_id(&self) -> i64 {
        self.task_id
    }

    /// `gitea-task-<task id>`.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for AssignmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for AssignmentId {
    type Err = AssignmentIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}
