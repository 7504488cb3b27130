//! Why a workflow cannot run: where (the file, a line and column when the YAML parser knows
//! them, the field as a dotted path) and what, as separate fields, so a front end can point at
//! the place without parsing the text.

use std::fmt;

/// A workflow that cannot run, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError {
    /// The workflow file (or what stands for it, e.g. a job's stored workflow).
    pub file: String,
    /// 1-based line and column in the file.
    pub at: Option<(usize, usize)>,
    /// The field, as a dotted path (`stages[1].algorithm.lr`).
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
    /// The lines of the file around `at`, with a caret.
    pub snippet: Option<String>,
}

impl PlanError {
    /// An error about the file as a whole.
    pub fn new(file: &str, message: impl Into<String>) -> Self {
        Self {
            file: file.to_string(),
            at: None,
            field: None,
            message: message.into(),
            snippet: None,
        }
    }

    /// An error about one field.
    pub fn field(file: &str, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.into()),
            ..Self::new(file, message)
        }
    }
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some((line, column)) = self.at {
            write!(f, ":{line}:{column}")?;
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        f.write_str(&self.message)?;
        if let Some(s) = &self.snippet {
            write!(f, "\n{s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PlanError {}
