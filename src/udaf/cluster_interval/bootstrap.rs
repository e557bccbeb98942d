//! The wild cluster bootstrap-t: Rademacher weights (Webb's six-point weights below
//! [`WEBB_BELOW`] clusters), studentized by the CR2 SE, clusters in a canonical order so a
//! seed gives the same interval under any partitioning.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

pub(super) struct BootResult {
    /// The symmetric percentile-t critical value: the `level` quantile of |t*|.
    pub(super) crit: f64,
    /// WCR p-value of mean = 0.
    pub(super) p_value: Option<f64>,
}

/// Draws one weight per cluster: Rademacher, or Webb's six points below [`WEBB_BELOW`].
pub(super) fn draw_weights(rng: &mut StdRng, w: &mut [f64]) {
    const WEBB: [f64; 6] = [
        -1.224_744_871_391_589, // -sqrt(3/2)
        -1.0,
        -std::f64::consts::FRAC_1_SQRT_2,
        std::f64::consts::FRAC_1_SQRT_2,
        1.0,
        1.224_744_871_391_589,
    ];
    if w.len() < WEBB_BELOW {
        w.iter_mut()
            .for_each(|x| *x = WEBB[rng.gen_range(0..6usize)]);
    } else {
        w.iter_mut()
            .for_each(|x| *x = if rng.gen_bool(0.5) { 1.0 } else { -1.0 });
    }
}

/// Wild cluster bootstrap-t of the mean.
///
/// Unrestricted (for the interval): `y*_i = mean + w_g e_i`, so the bootstrap mean moves by
/// `d = sum_g w_g S_g / N` and the cluster residual sums become `w_g S_g - n_g d`.
/// Restricted (for the p-value of mean = 0): `y*_i = w_g y_i`, cluster sums `T_g = S_g + n_g
/// mean`. Both statistics are studentized by the CR2 SE of the bootstrap sample.
pub(super) fn wild_bootstrap(r: &Residuals, se: f64, spec: &IntervalSpec) -> BootResult {
    let mut cells = r.cells.clone();
    // Canonical order: the draw does not depend on how partitions were merged.
    cells.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let n = r.n;
    let g = cells.len();
    let reps = spec.bootstrap.reps.max(1) as usize;
    let mut rng = StdRng::seed_from_u64(spec.bootstrap.seed);
    let mut w = vec![0.0; g];
    let mut t_unres = Vec::with_capacity(reps);
    let t_obs = r.mean / se;
    let mut extreme = 0usize;
    let studentized = |w: &[f64], centre: f64, shift: f64| -> f64 {
        // Bootstrap cluster sums w_g (S_g + n_g shift); their mean offset d; CR2 of the
        // residuals about the bootstrap mean.
        let d: f64 = cells
            .iter()
            .zip(w)
            .map(|((ng, s), wg)| wg * (s + ng * shift))
            .sum::<f64>()
            / n;
        let v = cr2_var(
            n,
            cells
                .iter()
                .zip(w)
                .map(|((ng, s), wg)| (*ng, wg * (s + ng * shift) - ng * d)),
        );
        let num = d - centre;
        if v > 0.0 {
            num / v.sqrt()
        } else if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    };
    for _ in 0..reps {
        draw_weights(&mut rng, &mut w);
        t_unres.push(studentized(&w, 0.0, 0.0).abs());
        // Null mean = 0 imposed: y* = w_g y_i, so cluster sums are w_g (S_g + n_g mean) and
        // the bootstrap mean is d itself.
        let t_res = studentized(&w, 0.0, r.mean);
        // Ties count as extreme. Some draws reproduce |t| exactly in exact arithmetic (all
        // weights 1 under the null), so a tolerance keeps rounding (which differs with the
        // merge order of partitions) from deciding them.
        if t_res.abs() + TIE_TOL * (1.0 + t_obs.abs()) >= t_obs.abs() {
            extreme += 1;
        }
    }
    t_unres.sort_by(f64::total_cmp);
    // The ceil(level (B + 1))-th smallest |t*| (950th of 999 at 95%).
    let k = ((spec.level * (reps as f64 + 1.0)).ceil() as usize).clamp(1, reps);
    BootResult {
        crit: t_unres[k - 1],
        p_value: Some(extreme as f64 / reps as f64),
    }
}
