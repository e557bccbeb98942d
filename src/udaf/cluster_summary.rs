//! A group's clusters folded into sums per cluster size, so that an interval can be made
//! from clusters that are finished and forgotten.
//!
//! Every interval of [`super::cluster_interval`] but the wild bootstrap depends on the clusters
//! only through their sizes and the sums of their values: CR2 weighs cluster g by
//! `1 / (1 - n_g / N)`, its degrees of freedom use `n_g / N` only, the one-way ANOVA weighs by
//! `n_g`. Clusters of one size are exchangeable in all of them, so keeping per size the number
//! of clusters and the moments of their sums is exact (up to rounding). A stage that reads the
//! templates in slices (`stages::aggregate`, rescore's diff) folds each slice's finished
//! clusters in and keeps only this: memory for the distinct sizes, not for the templates.

use std::collections::BTreeMap;

use super::common::Moments;

/// Per group: the overall moments and, per cluster size, the moments of the cluster sums.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSummary {
    /// Moments over every row of every cluster.
    pub total: Moments,
    /// Cluster size `n_g` -> moments of the sums `s_g` of the clusters of that size (its `n`
    /// counts clusters).
    classes: BTreeMap<u64, Moments>,
    /// `sum_g m2_g`, the within-cluster sum of squares.
    within: f64,
    /// Every cluster's moments were those of 0/1 values.
    all_binary: bool,
}

impl Default for ClusterSummary {
    fn default() -> Self {
        ClusterSummary {
            total: Moments::default(),
            classes: BTreeMap::new(),
            within: 0.0,
            all_binary: true,
        }
    }
}

/// Whether a cluster's moments are those of 0/1 values: a mean in [0, 1] and the largest
/// spread such a mean allows, m2 = n mean (1 - mean) (equality holds only when every value is
/// 0 or 1), up to rounding.
pub fn is_binary(c: &Moments) -> bool {
    if c.n == 0 {
        return true;
    }
    let n = c.n as f64;
    (0.0..=1.0).contains(&c.mean) && (c.m2 - n * c.mean * (1.0 - c.mean)).abs() <= 1e-9 * n
}

impl ClusterSummary {
    /// The summary of per-cluster moments (empty cells are ignored).
    pub fn of(cells: &[Moments]) -> ClusterSummary {
        let mut s = ClusterSummary::default();
        cells.iter().for_each(|c| s.add(c));
        s
    }

    /// Folds in one finished cluster.
    pub fn add(&mut self, c: &Moments) {
        if c.n == 0 {
            return;
        }
        self.total.merge(c);
        self.within += c.m2.max(0.0);
        self.all_binary &= is_binary(c);
        self.classes
            .entry(c.n)
            .or_default()
            .push(c.n as f64 * c.mean);
    }

    /// Merges the summary of other clusters (never the same clusters: a cluster split over
    /// two summaries would count as two).
    pub fn merge(&mut self, o: &ClusterSummary) {
        self.total.merge(&o.total);
        self.within += o.within;
        self.all_binary &= o.all_binary;
        for (k, m) in &o.classes {
            self.classes.entry(*k).or_default().merge(m);
        }
    }

    /// Clusters with at least one row.
    pub fn n_clusters(&self) -> usize {
        self.classes.values().map(|m| m.n as usize).sum()
    }

    /// Whether every cluster held 0/1 values only.
    pub fn all_binary(&self) -> bool {
        self.all_binary
    }

    /// `(size, clusters of that size)`, ascending by size.
    pub fn sizes(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.classes.iter().map(|(k, m)| (*k as f64, m.n as f64))
    }

    /// `sum_g w(n_g) S_g^2` with `S_g = s_g - n_g mean` the cluster's residual sum: per size
    /// k, `sum (s_g - k mean)^2 = m2_k + c_k (mean_k - k mean)^2`.
    pub fn weighted_score_sq(&self, w: impl Fn(f64) -> f64) -> f64 {
        let m = self.total.mean;
        self.classes
            .iter()
            .map(|(k, c)| {
                let k = *k as f64;
                let d = c.mean - k * m;
                (c.m2.max(0.0) + c.n as f64 * d * d) * w(k)
            })
            .sum()
    }

    /// `sum_g S_g^2`.
    pub fn score_sq(&self) -> f64 {
        self.weighted_score_sq(|_| 1.0)
    }

    /// `sum_g m2_g`.
    pub fn within(&self) -> f64 {
        self.within
    }

    /// `sum_g (m2_g + n_g mean_g^2)`, the sum of squared values.
    pub fn sum_sq(&self) -> f64 {
        self.within
            + self
                .classes
                .iter()
                .map(|(k, c)| (c.m2.max(0.0) + c.n as f64 * c.mean * c.mean) / *k as f64)
                .sum::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::udaf::common::moments_of as cell;

    #[test]
    fn sums_by_size_equal_the_sums_over_clusters() {
        let cells = [
            cell(&[1.0, 0.0, 1.0]),
            cell(&[0.5, 2.5]),
            cell(&[3.0, 1.0, 0.0]),
            cell(&[]),
            cell(&[2.0, 2.0]),
            cell(&[7.0]),
        ];
        let s = ClusterSummary::of(&cells);
        assert_eq!(s.n_clusters(), 5);
        assert_eq!(s.total.n, 11);
        let mean = 20.0 / 11.0;
        let direct: f64 = cells
            .iter()
            .filter(|c| c.n > 0)
            .map(|c| (c.n as f64 * (c.mean - mean)).powi(2) / (1.0 - c.n as f64 / 11.0))
            .sum();
        let by_size = s.weighted_score_sq(|k| 1.0 / (1.0 - k / 11.0));
        assert!(
            (direct - by_size).abs() < 1e-12 * direct,
            "{direct} {by_size}"
        );
        let sq: f64 = [1.0, 0.0, 1.0, 0.5, 2.5, 3.0, 1.0, 0.0, 2.0, 2.0, 7.0]
            .iter()
            .map(|x| x * x)
            .sum();
        assert!((s.sum_sq() - sq).abs() < 1e-12 * sq);
        assert!(!s.all_binary());
        assert_eq!(
            s.sizes().collect::<Vec<_>>(),
            vec![(1.0, 1.0), (2.0, 2.0), (3.0, 2.0)]
        );
        // Merging the summaries of two disjoint halves gives the summary of all.
        let mut a = ClusterSummary::of(&cells[..3]);
        a.merge(&ClusterSummary::of(&cells[3..]));
        assert_eq!(a.n_clusters(), 5);
        assert!((a.score_sq() - s.score_sq()).abs() < 1e-12 * s.score_sq());
        assert!(ClusterSummary::of(&[cell(&[0.0, 1.0]), cell(&[1.0])]).all_binary());
    }

    /// Every method but the bootstrap gives the interval of the cells from their summary,
    /// for means and rates, equal and unequal sizes, and for paired differences.
    #[test]
    fn intervals_of_a_summary_are_those_of_its_cells() {
        use super::super::cluster_interval::{
            IntervalSpec, Method, cluster_interval, paired_interval, paired_summary_interval,
            summary_interval,
        };
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(7);
        let close = |a: Option<f64>, b: Option<f64>, what: &str| match (a, b) {
            (Some(a), Some(b)) => assert!(
                (a - b).abs() <= 1e-12 * b.abs().max(1e-3),
                "{what}: {a} {b}"
            ),
            (a, b) => assert_eq!(a, b, "{what}"),
        };
        for case in 0..40 {
            let g = 2 + case % 9;
            let binary = case % 2 == 0;
            let paired = case % 4 == 0;
            let cells: Vec<Moments> = (0..g)
                .map(|_| {
                    let size = 1 + rng.gen_range(0..if case % 3 == 0 { 3 } else { 12 });
                    let p: f64 = rng.r#gen();
                    let xs: Vec<f64> = (0..size)
                        .map(|_| match (binary, paired) {
                            (true, true) => [-1.0, 0.0, 0.0, 1.0][rng.gen_range(0..4)],
                            (true, false) => f64::from(rng.gen_bool(p * 0.3)),
                            _ => rng.gen_range(-2.0..5.0),
                        })
                        .collect();
                    cell(&xs)
                })
                .collect();
            let s = ClusterSummary::of(&cells);
            for method in [
                Method::Auto,
                Method::Miller,
                Method::Cr1T,
                Method::Cr2,
                Method::Cr2Wilson,
                Method::Cr2Score,
                Method::Cr2Ri,
            ] {
                let spec = IntervalSpec {
                    method,
                    ..IntervalSpec::default()
                };
                let (a, b) = if paired {
                    (
                        paired_summary_interval(&s, &spec, binary),
                        paired_interval(&cells, &spec, binary),
                    )
                } else {
                    (summary_interval(&s, &spec), cluster_interval(&cells, &spec))
                };
                let what = format!("case {case} {method:?}");
                assert_eq!(
                    (a.n, a.n_clusters, a.method),
                    (b.n, b.n_clusters, b.method),
                    "{what}"
                );
                for (x, y, f) in [
                    (a.se, b.se, "se"),
                    (a.lo, b.lo, "lo"),
                    (a.hi, b.hi, "hi"),
                    (a.df, b.df, "df"),
                    (a.p_value, b.p_value, "p"),
                ] {
                    close(x, y, &format!("{what} {f}"));
                }
            }
        }
    }
}
