//! The train / conformal / test split by unit: every row of a unit lands in exactly one split,
//! so no unit's answers leak from training into calibration or evaluation.

use std::collections::BTreeMap;

use rand::SeedableRng;
use rand::seq::SliceRandom;

/// Which split a unit belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    Train,
    Conformal,
    Test,
}

impl Split {
    pub fn as_str(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Conformal => "conformal",
            Split::Test => "test",
        }
    }
}

/// Split fractions, e.g. the paper's 50:10:40.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fractions {
    pub train: f64,
    pub conformal: f64,
    pub test: f64,
}

impl Default for Fractions {
    fn default() -> Self {
        Fractions {
            train: 0.5,
            conformal: 0.1,
            test: 0.4,
        }
    }
}

impl Fractions {
    /// Parses `50:10:40` (any positive numbers; normalised to sum to 1).
    pub fn parse(s: &str) -> Result<Self, String> {
        let v: Vec<f64> = s
            .split(':')
            .map(|x| x.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("split `{s}`: {e}"))?;
        let [a, b, c] = v[..] else {
            return Err(format!("split `{s}`: expected three numbers like 50:10:40"));
        };
        let sum = a + b + c;
        if !(a > 0.0 && b > 0.0 && c > 0.0 && sum.is_finite()) {
            return Err(format!("split `{s}`: all three parts must be positive"));
        }
        Ok(Fractions {
            train: a / sum,
            conformal: b / sum,
            test: c / sum,
        })
    }
}

/// Assigns each unit to a split: the sorted units are shuffled with `seed`, then cut by the
/// fractions (rounded, so counts sum to the number of units).
pub fn split_units(units: &[String], f: Fractions, seed: u64) -> BTreeMap<String, Split> {
    let mut u: Vec<&String> = units.iter().collect();
    u.sort();
    u.dedup();
    u.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let n = u.len() as f64;
    let n_train = (n * f.train).round() as usize;
    let n_conf = ((n * (f.train + f.conformal)).round() as usize).saturating_sub(n_train);
    u.into_iter()
        .enumerate()
        .map(|(i, unit)| {
            let s = if i < n_train {
                Split::Train
            } else if i < n_train + n_conf {
                Split::Conformal
            } else {
                Split::Test
            };
            (unit.clone(), s)
        })
        .collect()
}

/// Cross-validation folds by unit: fold `i` of `k` for each unit, seeded.
pub fn unit_folds(units: &[String], k: usize, seed: u64) -> BTreeMap<String, usize> {
    let mut u: Vec<&String> = units.iter().collect();
    u.sort();
    u.dedup();
    u.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9));
    u.into_iter()
        .enumerate()
        .map(|(i, unit)| (unit.clone(), i % k.max(1)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_by_unit_seeded_and_sized() {
        let units: Vec<String> = (0..200).map(|i| format!("u{i}")).collect();
        let a = split_units(&units, Fractions::default(), 7);
        let b = split_units(&units, Fractions::default(), 7);
        assert_eq!(a, b);
        let count = |s| a.values().filter(|&&x| x == s).count();
        assert_eq!(
            (
                count(Split::Train),
                count(Split::Conformal),
                count(Split::Test)
            ),
            (100, 20, 80)
        );
        assert_ne!(a, split_units(&units, Fractions::default(), 8));
    }

    #[test]
    fn fractions_parse() {
        let f = Fractions::parse("50:10:40").unwrap();
        assert!((f.conformal - 0.1).abs() < 1e-12);
        assert!(Fractions::parse("1:2").is_err());
        assert!(Fractions::parse("1:0:2").is_err());
    }
}
