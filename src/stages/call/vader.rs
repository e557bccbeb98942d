//! `builtin:vader`: the VADER sentiment analyser as an in-process model under test.
//!
//! It needs no network and no key, so `evalflow run pipelines/sentiment.toml` works on a
//! fresh machine. The answer is a label (positive / negative / neutral at compound
//! at least 0.05 / at most -0.05, VADER's published thresholds) and `response_score` is the compound
//! score, so INV/DIR tolerances apply to a continuous output. The analyser is
//! [`crate::vader`], a port of vaderSentiment 3.3.2 (the `vader_sentiment` crate diverges).

use super::{CallRequest, CallResult, Provider};

/// VADER's compound score for `text`, exactly as vaderSentiment 3.3.2 reports it (see
/// [`crate::vader`], a port of the reference implementation).
pub fn compound(text: &str) -> f64 {
    crate::vader::compound(text)
}

/// The label VADER's authors recommend for a compound score.
pub fn label(compound: f64) -> &'static str {
    if compound >= 0.05 {
        "positive"
    } else if compound <= -0.05 {
        "negative"
    } else {
        "neutral"
    }
}

/// The in-process VADER provider.
#[derive(Debug, Default)]
pub struct Vader;

#[async_trait::async_trait]
impl Provider for Vader {
    async fn complete(&self, req: &CallRequest) -> CallResult {
        let c = compound(&req.input);
        CallResult {
            response: Some(label(c).to_string()),
            response_score: Some(c),
            finish_reason: Some("stop".into()),
            http_status: None,
            attempts: 1,
            ..CallResult::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_follow_vader() {
        assert_eq!(label(0.05), "positive");
        assert_eq!(label(0.049), "neutral");
        assert_eq!(label(-0.05), "negative");
    }

    #[test]
    fn known_sentences() {
        assert!(compound("The food is great.") > 0.5);
        assert!(compound("The food is terrible.") < -0.4);
    }
}
