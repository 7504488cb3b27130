//! Reward functions over decoded responses.

use serde::{Deserialize, Serialize};

/// Which reward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields, tag = "type")]
pub enum Reward {
    /// 1 when the response (trimmed) equals the answer, else 0.
    ExactMatch,
}

impl Reward {
    /// Scores one response against its answer.
    pub fn score(&self, response: &str, answer: &str) -> f32 {
        match self {
            Reward::ExactMatch => f32::from(u8::from(response.trim() == answer.trim())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_match() {
        assert_eq!(Reward::ExactMatch.score(" 82", "82"), 1.0);
        assert_eq!(Reward::ExactMatch.score("820", "82"), 0.0);
    }
}
