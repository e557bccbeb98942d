//! The paper's metrics: RMSE against human labels, inter-judge agreement and self-consistency.
//!
//! Agreement and self-consistency use no labels: each row's score is mapped to [0, 1] and two
//! scores `a, b` disagree by `|a - b|`. For one unit, agreement of judges A and B is
//! `1 - mean |a - b|` over the T_A x T_B trial pairs; self-consistency of a judge is
//! `1 - mean |a - b|` over its T (T - 1) / 2 pairs of trials (the `self_consistency` SQL
//! function). Both are then averaged over units.

use std::collections::BTreeMap;

/// Root mean squared error; NaN when empty.
pub fn rmse(pred: &[f64], truth: &[f64]) -> f64 {
    let n = pred.len();
    let ss: f64 = pred.iter().zip(truth).map(|(p, t)| (p - t).powi(2)).sum();
    (ss / n as f64).sqrt()
}

/// The CheckEval baseline: the fraction of YES rescaled to the label range.
pub fn baseline_score(fraction_yes: f64, range: (f64, f64)) -> f64 {
    range.0 + fraction_yes * (range.1 - range.0)
}

/// Maps a score in `range` to [0, 1] (clipped).
pub fn to_unit(x: f64, range: (f64, f64)) -> f64 {
    let span = range.1 - range.0;
    if span <= 0.0 {
        return 0.0;
    }
    ((x - range.0) / span).clamp(0.0, 1.0)
}

/// A scored row: unit, judge and a score in [0, 1].
#[derive(Debug, Clone)]
pub struct Scored<'a> {
    pub unit: &'a str,
    pub judge: &'a str,
    pub score: f64,
}

type ByUnit<'a> = BTreeMap<&'a str, BTreeMap<&'a str, Vec<f64>>>;

fn by_unit<'a>(rows: &[Scored<'a>]) -> ByUnit<'a> {
    let mut m: ByUnit = BTreeMap::new();
    for r in rows {
        m.entry(r.unit)
            .or_default()
            .entry(r.judge)
            .or_default()
            .push(r.score);
    }
    m
}

/// Agreement of judges `a` and `b` for one unit: 1 - mean |x - y| over all trial pairs.
pub fn pair_agreement(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let s: f64 = a
        .iter()
        .flat_map(|x| b.iter().map(move |y| (x - y).abs()))
        .sum();
    Some(1.0 - s / (a.len() * b.len()) as f64)
}

/// The judge x judge agreement table, averaged over units that both judges scored. The
/// diagonal holds each judge's self-consistency.
pub fn agreement_table(rows: &[Scored], judges: &[String]) -> Vec<Vec<Option<f64>>> {
    let m = by_unit(rows);
    let sc = self_consistency(rows);
    judges
        .iter()
        .map(|a| {
            judges
                .iter()
                .map(|b| {
                    if a == b {
                        return sc.get(a.as_str()).copied();
                    }
                    mean(m.values().filter_map(|per| {
                        pair_agreement(per.get(a.as_str())?, per.get(b.as_str())?)
                    }))
                })
                .collect()
        })
        .collect()
}

/// Self-consistency per judge, averaged over units with at least two trials.
pub fn self_consistency<'a>(rows: &[Scored<'a>]) -> BTreeMap<&'a str, f64> {
    let m = by_unit(rows);
    let mut acc: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for per in m.values() {
        for (j, v) in per {
            let mut v = v.clone();
            if let Some(s) = crate::udaf::self_consistency::self_consistency(&mut v) {
                acc.entry(j).or_default().push(s);
            }
        }
    }
    acc.into_iter()
        .filter_map(|(j, v)| Some((j, mean(v.into_iter())?)))
        .collect()
}

/// The mean of the off-diagonal cells.
pub fn mean_off_diagonal(t: &[Vec<Option<f64>>]) -> Option<f64> {
    mean(t.iter().enumerate().flat_map(|(i, r)| {
        r.iter()
            .enumerate()
            .filter_map(move |(j, x)| if i == j { None } else { *x })
    }))
}

fn mean(it: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_counts_all_trial_pairs() {
        // T^2 = 4 pairs: |0-0.5|, |0-1|, |1-0.5|, |1-1| -> mean 0.5.
        assert_eq!(pair_agreement(&[0.0, 1.0], &[0.5, 1.0]), Some(0.5));
        let rows = [
            Scored {
                unit: "u",
                judge: "a",
                score: 0.0,
            },
            Scored {
                unit: "u",
                judge: "a",
                score: 1.0,
            },
            Scored {
                unit: "u",
                judge: "b",
                score: 0.5,
            },
            Scored {
                unit: "u",
                judge: "b",
                score: 1.0,
            },
        ];
        let t = agreement_table(&rows, &["a".into(), "b".into()]);
        assert_eq!(t[0][1], Some(0.5));
        // Self-consistency of a over its one pair: 1 - 1 = 0; of b: 1 - 0.5.
        assert_eq!(t[0][0], Some(0.0));
        assert_eq!(t[1][1], Some(0.5));
        assert!((rmse(&[1.0, 3.0], &[2.0, 2.0]) - 1.0).abs() < 1e-12);
        assert_eq!(baseline_score(0.5, (1.0, 5.0)), 3.0);
    }
}
