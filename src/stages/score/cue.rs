//! The cue polarity scorer: does the answer recommend, reject or merely mention a named
//! entity (the case's `expected` column)?
//!
//! Two failure shapes from six-checks-before-you-trust are designed out here:
//! - negated phrases contain their positive form (不建议 contains 建议; "not recommended"
//!   contains "recommended"), so rejection cues are found and masked *before* positive
//!   cues are tested;
//! - name-matching is not attribution: only the sentences that mention the entity are read,
//!   so a neighbour's praise is not credited to it.
//!
//! Cue lists are per language and can be replaced from a TOML file; the scorer's version
//! then carries the lists' hash, so numbers made with other cues never share a version.

use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{BaseAnswer, Outcome, ScoreInput, Scorer, ScorerError, ScorerId, source_logic};

/// Cue phrases for one language.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Cues {
    /// Phrases that rule the entity out (including negated recommendations).
    pub reject: Vec<String>,
    /// Phrases that recommend it.
    pub recommend: Vec<String>,
}

/// Cue lists by language (`en`, `zh`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CueLists {
    pub en: Cues,
    pub zh: Cues,
}

/// The built-in cue lists.
pub const DEFAULT_CUES: &str = include_str!("cues.toml");

/// The cue scorer.
#[derive(Debug, Clone)]
pub struct CueScorer {
    lists: CueLists,
    /// Set when the lists came from a file: their hash becomes part of the version.
    custom_hash: Option<String>,
}

impl Default for CueScorer {
    fn default() -> Self {
        Self {
            lists: toml::from_str(DEFAULT_CUES).expect("built-in cues.toml parses"),
            custom_hash: None,
        }
    }
}

impl CueScorer {
    /// Loads replacement cue lists from a TOML file of the same shape as `cues.toml`.
    pub fn from_file(path: &Path) -> Result<Self, ScorerError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ScorerError::Cues {
            file: file.clone(),
            msg: e.to_string(),
        })?;
        let lists: CueLists = toml::from_str(&text).map_err(|e| ScorerError::Cues {
            file,
            msg: e.to_string(),
        })?;
        let hash = hex::encode(Sha256::digest(text.as_bytes()))[..8].to_string();
        Ok(Self {
            lists,
            custom_hash: (text != DEFAULT_CUES).then_some(hash),
        })
    }

    fn cues_for(&self, language: &str) -> Vec<&Cues> {
        match language {
            "zh" => vec![&self.lists.zh],
            "mixed" => vec![&self.lists.zh, &self.lists.en],
            _ => vec![&self.lists.en],
        }
    }
}

/// Splits text into sentences on CJK and Latin sentence ends, semicolons and line breaks.
pub fn sentences(text: &str) -> Vec<&str> {
    text.split(['。', '！', '？', '；', '!', '?', ';', '\n'])
        .flat_map(|s| s.split(". "))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

/// The polarity of `entity` in `text`: `recommended`, `rejected`, `neutral` (mentioned,
/// no cue) or `absent`, with the cues that decided it.
pub fn polarity(text: &str, entity: &str, cues: &[&Cues]) -> (&'static str, Vec<String>) {
    let entity_l = entity.to_lowercase();
    let mentioned: Vec<String> = sentences(text)
        .into_iter()
        .map(str::to_lowercase)
        .filter(|s| s.contains(&entity_l))
        .collect();
    if mentioned.is_empty() {
        return ("absent", vec![]);
    }
    let mut rejects = Vec::new();
    let mut recommends = Vec::new();
    for sentence in &mentioned {
        // Mask the entity itself, so a brand called "Best Choice" is not a cue.
        let mut masked = sentence.replace(&entity_l, " \u{1} ");
        for c in cues {
            for r in &c.reject {
                let r = r.to_lowercase();
                if masked.contains(&r) {
                    rejects.push(r.clone());
                    masked = masked.replace(&r, " \u{2} ");
                }
            }
        }
        for c in cues {
            for p in &c.recommend {
                let p = p.to_lowercase();
                if masked.contains(&p) {
                    recommends.push(p);
                }
            }
        }
    }
    if !rejects.is_empty() {
        ("rejected", rejects)
    } else if !recommends.is_empty() {
        ("recommended", recommends)
    } else {
        ("neutral", vec![])
    }
}

impl Scorer for CueScorer {
    fn id(&self) -> ScorerId {
        let base = "1";
        ScorerId {
            name: "cue".into(),
            version: match &self.custom_hash {
                Some(h) => format!("{base}+cues-{h}"),
                None => base.into(),
            },
        }
    }

    fn logic(&self) -> Vec<String> {
        vec![
            source_logic(include_str!("cue.rs")),
            DEFAULT_CUES.to_string(),
        ]
    }

    fn score(&self, row: &ScoreInput, _base: Option<&BaseAnswer>) -> Outcome {
        let Some(entity) = row.expected.filter(|e| !e.trim().is_empty()) else {
            return Outcome {
                detail: serde_json::json!({ "not_comparable": "the case names no entity in `expected`" }),
                ..Outcome::default()
            };
        };
        let (label, fired) = polarity(row.response, entity, &self.cues_for(row.language));
        Outcome {
            score: Some(if label == "recommended" { 1.0 } else { 0.0 }),
            label: Some(label.to_string()),
            detail: serde_json::json!({ "entity": entity, "cues": fired, "language": row.language }),
            ..Outcome::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str, entity: &str) -> &'static str {
        let s = CueScorer::default();
        let lang = crate::validity::language(text);
        polarity(text, entity, &s.cues_for(&lang)).0
    }

    #[test]
    fn negation_is_masked_before_positive_cues() {
        // The seed's example: a brand named in order to rule it out.
        let zh = "之前推荐的一些\"顶配\"品牌（如 Asana、Monday.com 的付费版）基本都超了，不建议强行上付费版";
        assert_eq!(p(zh, "Asana"), "rejected");
        assert_eq!(p("不建议使用 Notion。", "Notion"), "rejected");
        assert_eq!(p("建议使用 Notion。", "Notion"), "recommended");
        assert_eq!(
            p("Trello is not recommended for large teams.", "Trello"),
            "rejected"
        );
        assert_eq!(
            p("I would recommend Trello for small teams.", "Trello"),
            "recommended"
        );
        assert_eq!(p("I don't recommend Trello.", "Trello"), "rejected");
    }

    #[test]
    fn polarity_is_attributed_to_the_entity_sentence() {
        let text = "Asana is the best choice for you. Jira is over budget.";
        assert_eq!(p(text, "Asana"), "recommended");
        assert_eq!(p(text, "Jira"), "rejected");
        assert_eq!(p(text, "Notion"), "absent");
        assert_eq!(p("Linear is a tool that exists.", "Linear"), "neutral");
    }

    #[test]
    fn custom_cues_change_the_version() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cues.toml");
        std::fs::write(&f, DEFAULT_CUES).unwrap();
        assert_eq!(CueScorer::from_file(&f).unwrap().id().version, "1");
        std::fs::write(&f, DEFAULT_CUES.replace("\"avoid\", ", "")).unwrap();
        assert!(
            CueScorer::from_file(&f)
                .unwrap()
                .id()
                .version
                .starts_with("1+cues-")
        );
    }
}
